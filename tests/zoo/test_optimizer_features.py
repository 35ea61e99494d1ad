"""Every optimizer feature a level must keep, on a transformer (KerasHub's
token and position embedding and encoder block): a learning-rate schedule,
decoupled weight decay, an EMA of the weights, global clipping (of the
unscaled gradients), compared with the same optimizer in float32 step by
step. On TensorFlow the token embeddings' gradients are `IndexedSlices`."""

import keras
import numpy as np
import pytest

from tests.zoo import runs
from tests.zoo.runs import BACKEND
from tests.zoo.runs import TORCH
from tests.zoo.runs import np64

pytestmark = pytest.mark.zoo


# How far a level's updates may be from float32's, over their size, after
# six steps (measured at most 0.005 in float16, 0.004 in bfloat16; BERT's
# reached 0.049 in bfloat16); each feature's own effect is larger, 0.25 and
# more (`test_each_optimizer_feature_moves_the_updates_more_than_a_level_may`).
UPDATE_TOLERANCE = {"float16": 0.02, "bfloat16": 0.08}
FAMILY = "transformer_encoder"
_FEATURE_RUNS = {}


def _features_optimizer(without=None):
    """SGD with every feature a level must keep: a learning-rate schedule,
    decoupled weight decay, an EMA of the weights, global clipping (of the
    unscaled gradients; Adam's updates would hardly see a gradient's norm);
    `without` one of them."""
    kwargs = {
        "learning_rate": keras.optimizers.schedules.CosineDecay(0.5, decay_steps=6, alpha=0.01),
        "weight_decay": 0.01,
        "use_ema": True,
        "ema_momentum": 0.9,
        "global_clipnorm": 0.05,
    }
    if without == "schedule":
        kwargs["learning_rate"] = 0.5
    elif without == "weight_decay":
        del kwargs["weight_decay"]
    elif without == "ema":
        del kwargs["use_ema"], kwargs["ema_momentum"]
    elif without == "clipping":
        del kwargs["global_clipnorm"]
    return keras.optimizers.SGD(**kwargs)


def _features_run(level=None, half=None, without=None):
    """The transformer's updates, its EMA and its optimizer after three
    epochs (six steps, in order): float32 (`level` None, eagerly on
    TensorFlow; once per process) or at `level` in `half`, compiled."""
    key = (level, half, without)
    if level is None and key in _FEATURE_RUNS:
        return _FEATURE_RUNS[key]
    model, x, y, loss = runs.model(FAMILY)
    inner = _features_optimizer(without)
    amp = {} if level is None else {"amp_level": level, "amp_dtype": half}
    if half == "float16":
        # A fixed scale: the dynamic one starts at 2**15 and skips this
        # model's first steps, which the float32 run takes.
        amp["loss_scale"] = 2.0**10
    model.compile(
        optimizer=inner, loss=loss, run_eagerly=level is None and BACKEND == "tensorflow", **amp
    )
    before = [np64(v) for v in model.trainable_variables]
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    updates = [np64(v) - b for v, b in zip(model.trainable_variables, before)]
    averages = [np64(v) for v in getattr(inner, "_model_variables_moving_average", [])]
    run = {"updates": updates, "before": before, "averages": averages, "model": model, "x": x}
    run["optimizer"] = inner
    if level is None:
        _FEATURE_RUNS[key] = run
    return run


def _distance(run, reference):
    """The distance of `run`'s updates from `reference`'s, over their size."""
    got = np.concatenate([u.ravel() for u in run["updates"]])
    want = np.concatenate([u.ravel() for u in reference["updates"]])
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def _decay(run, rows, index):
    """The factor the weight decay alone applied to the `rows` of the
    variable at `index` (token embeddings no batch holds: no gradient)."""
    return 1.0 + run["updates"][index][rows] / run["before"][index][rows]


def _unseen_embedding_rows(run):
    """The token embeddings' index among the variables, and the rows of the
    ids the batch never holds (their gradient is 0)."""
    variables = run["model"].trainable_variables
    index = next(i for i, v in enumerate(variables) if "token_embedding" in v.path)
    rows = np.setdiff1d(np.arange(variables[index].shape[0]), run["x"])
    assert len(rows) > 10
    return rows, index


@pytest.mark.one_backend
def test_each_optimizer_feature_moves_the_updates_more_than_a_level_may():
    """In float32, the schedule, the EMA and the clipping each change the
    transformer's updates by more than twice the widest tolerance a level is
    held to, and the weight decay alone moves the embeddings no batch holds:
    a level that lost one would fail `test_optimizer_features_on_a_transformer`
    (the same float32 arithmetic on every backend)."""
    reference = _features_run()
    for feature in ("schedule", "ema", "clipping"):
        distance = _distance(_features_run(without=feature), reference)
        assert distance > 2 * max(UPDATE_TOLERANCE.values()), (feature, distance)
    rows, index = _unseen_embedding_rows(reference)
    assert np.max(_decay(reference, rows, index)) < 0.995
    # Without it they stay (but for the EMA's rounding, 1e-7).
    np.testing.assert_allclose(
        _decay(_features_run(without="weight_decay"), rows, index), 1.0, atol=1e-6
    )


@pytest.mark.skipif(
    BACKEND == "jax", reason="JAX's step with each feature: tests/optimizer/test_inner_optimizer.py"
)
@pytest.mark.parametrize(
    "level, half",
    [
        ("O2", "float16"),
        pytest.param(
            "O1", "bfloat16", marks=pytest.mark.skipif(not TORCH, reason="CI time: compiled")
        ),
    ],
)
def test_optimizer_features_on_a_transformer(level, half):
    """SGD's learning-rate schedule, decoupled weight decay, EMA and global
    clipping under a level: the updates follow the same optimizer's in
    float32 step by step, within the half dtype's tolerance (each feature's
    own effect is larger than it), the decay moves the embeddings no batch
    holds by float32's factor, and `fit` ends by writing the averages into
    the weights. In float16 the clipping is of the unscaled gradients.

    Not O3 (CI time): O3's clipping, EMA and weight decay over float32 master
    weights are tested in test_inner_optimizer.py.
    """
    reference = _features_run()
    run = _features_run(level, half)
    assert _distance(run, reference) < UPDATE_TOLERANCE[half]
    inner = run["optimizer"]
    model = run["model"]
    assert inner is getattr(model.optimizer, "inner_optimizer", model.optimizer)
    assert int(np64(inner.iterations)) == 6
    rows, index = _unseen_embedding_rows(run)
    np.testing.assert_allclose(_decay(run, rows, index), _decay(reference, rows, index), rtol=1e-4)
    assert len(run["averages"]) == len(model.trainable_variables)
    for average, variable in zip(run["averages"], model.trainable_variables):
        np.testing.assert_array_equal(average, np64(variable))
