"""The chunked-loss rule (`rules.LOSS_RULES`): the plain loss where the
logits are small, or the model's shape, loss or metrics do not allow it;
chunk by chunk where they are large, or where asked."""

import keras
import pytest

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_rule
from keras_mp._src.precision import rules

pytestmark = pytest.mark.one_backend

VOCABULARY = 50_000
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def found():
    tokens = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 2)(tokens)
    return lm_head.find(keras.Model(tokens, keras.layers.Dense(VOCABULARY, name="head")(hidden)))


@pytest.mark.parametrize(
    "facts, chunked, reason",
    [
        (dict(tokens=8 * 1024), True, "float32 loss chunk by chunk through `head` (664 tokens"),
        (dict(tokens=None), True, "float32 loss chunk by chunk"),
        (dict(tokens=64), False, "plain loss: logits of 64 tokens x 50,000 under"),
        # A batch dimension not known when traced: not known small.
        (
            dict(tokens=lm_rule.AtLeast(64)),
            True,
            "float32 loss chunk by chunk through `head` (664 tokens a chunk, at least 64 tokens",
        ),
        (
            dict(tokens=64, setting=16),
            True,
            "float32 loss chunk by chunk through `head` (16 tokens",
        ),
        (dict(tokens=8 * 1024, setting=False), False, "plain loss: chunked_loss=False"),
        (dict(tokens=8 * 1024, own_step=True), False, "plain loss: your train_step"),
        (dict(tokens=64, own_step=True, setting=True), True, "float32 loss chunk by chunk"),
        (dict(tokens=8 * 1024, metric="auc"), False, "plain loss: metric `auc` reads the logits"),
        (dict(tokens=8 * 1024, loss="mse"), False, "plain loss: 'mse' is not Sparse"),
        (
            dict(tokens=8 * 1024, loss=keras.losses.SparseCategoricalCrossentropy()),
            False,
            "plain loss: SparseCategoricalCrossentropy is not",
        ),
    ],
)
def test_the_rule(found, facts, chunked, reason):
    facts = {"setting": None, "loss": LOSS, **facts}
    decided, said = rules.decide_loss(lm_rule.LossFacts(found=found, **facts))
    assert decided is chunked and said.startswith(reason), said


def test_a_model_without_a_head_keeps_the_plain_loss():
    facts = lm_rule.LossFacts(None, lm_head.Found(why="a subclassed model"), LOSS, tokens=10**6)
    assert rules.decide_loss(facts) == (False, "plain loss: a subclassed model")
