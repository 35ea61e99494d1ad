"""`fit`'s step of a language model computes its loss chunk by chunk: a
KerasHub GPT-2 (tied `ReversibleEmbedding` head, `CausalLM.compile`'s
weighted accuracy) follows the plain loss's run step by step; `predict` and
`evaluate` are as before; where the model's shape does not allow it, the
plain loss, said in `precision_summary`."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.steps import numpy

keras_hub = pytest.importorskip("keras_hub")

VOCABULARY, LENGTH, CHUNK = 61, 8, 5  # 16 tokens: chunks of 5, 5, 5 and 1

_rng = np.random.default_rng(0)
IDS = _rng.integers(1, VOCABULARY, (2, LENGTH)).astype("int32")
PADDING = np.ones((2, LENGTH), bool)
PADDING[1, -3:] = False
X = {"token_ids": IDS, "padding_mask": PADDING}
Y = np.roll(IDS, -1, axis=1)
SAMPLE_WEIGHT = PADDING.astype("float32")


def _gpt2(chunked_loss, weights=None):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        dropout=0.0,
        max_sequence_length=16,
    )
    return _compiled(
        keras_hub.models.GPT2CausalLM(backbone, preprocessor=None), chunked_loss, weights
    )


def _compiled(model, chunked_loss, weights):
    """`model` with `weights` (another's, or its own), compiled at O2 bfloat16."""
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        amp_level="O2",
        amp_dtype="bfloat16",
        chunked_loss=chunked_loss,
    )
    return model


@pytest.fixture(scope="module")
def models():
    """The same GPT-2, compiled with its loss chunk by chunk and without."""
    keras.utils.set_random_seed(0)
    plain = _gpt2(False)
    return _gpt2(CHUNK, plain.get_weights()), plain


def _small_pair(jit_compile="auto"):
    """A functional LM (table, norm, Dense head) with CausalLM's weighted
    accuracy, chunked and plain, the same weights."""

    def make(chunked_loss):
        keras.utils.set_random_seed(3)
        tokens = keras.Input((LENGTH,), dtype="int32")
        hidden = keras.layers.Embedding(VOCABULARY, 8)(tokens)
        hidden = keras.layers.LayerNormalization()(hidden)
        model = keras.Model(tokens, keras.layers.Dense(VOCABULARY)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
            amp_level="O2",
            amp_dtype="bfloat16",
            chunked_loss=chunked_loss,
            jit_compile=jit_compile,
        )
        return model

    return make(CHUNK), make(False)


# The step is each backend's; on JAX, whose compile of a GPT-2 step takes
# the most, the step's model is a small functional one (the GPT-2's step
# there is lowered by the perf test below).
STEP_MODELS = "small" if keras.backend.backend() == "jax" else "gpt2"


def test_a_language_model_follows_the_plain_loss_step_by_step(request):
    if STEP_MODELS == "gpt2":
        chunked, plain = request.getfixturevalue("models")
        head = "token_embedding"
        x = X
    else:
        chunked, plain = _small_pair()
        head = "dense"
        x = IDS
    for step in range(2):
        got = chunked.train_on_batch(x, Y, sample_weight=SAMPLE_WEIGHT, return_dict=True)
        want = plain.train_on_batch(x, Y, sample_weight=SAMPLE_WEIGHT, return_dict=True)
        # The first step's loss is the same logits'; then the weights differ
        # by the gradients' roundings (the head's float32 across chunks).
        rtol = 1e-5 if step == 0 else 2e-3
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=rtol, err_msg=f"step {step}")
        assert got["sparse_categorical_accuracy"] == pytest.approx(
            want["sparse_categorical_accuracy"], abs=1e-6
        ), step
    summary = keras_mp.precision_summary(chunked)
    assert summary.loss.startswith(f"float32 loss chunk by chunk through `{head}")
    assert keras_mp.precision_summary(plain).loss == "plain loss: chunked_loss=False"
    # Only the step changed: the model still returns its logits.
    logits = chunked.predict(x, verbose=0)
    assert logits.shape == (2, LENGTH, VOCABULARY) and logits.dtype == np.float32


@pytest.mark.skipif(
    keras.backend.backend() == "torch", reason="PyTorch's step is not compiled (jit_compile=False)"
)
def test_the_step_without_jit_compile_follows_the_plain_loss():
    """The other side of the step above (compiled by XLA there, by rule):
    TensorFlow's graph without XLA, JAX's ops one by one."""
    chunked, plain = _small_pair(jit_compile=False)
    got = chunked.train_on_batch(IDS, Y, sample_weight=SAMPLE_WEIGHT, return_dict=True)
    want = plain.train_on_batch(IDS, Y, sample_weight=SAMPLE_WEIGHT, return_dict=True)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(chunked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-3)
    assert keras_mp.precision_summary(chunked).loss.startswith("float32 loss chunk by chunk")


def _table_and_head(chunked_loss, seed, model_class=keras.Model, lora=False, **compiled):
    """An embedding table and a Dense head (its LoRA on where asked), seeded,
    compiled at O0 (SGD at 0.5 unless `compiled` says otherwise)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 8)(tokens)
    head = keras.layers.Dense(VOCABULARY)
    model = model_class(tokens, head(hidden))
    if lora:
        head.enable_lora(2)
    model.compile(
        **{"optimizer": keras.optimizers.SGD(0.5), **compiled},
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        amp_level="O0",
        chunked_loss=chunked_loss,
    )
    return model


@pytest.mark.one_backend
@pytest.mark.parametrize("table", ["half", "float32"])
def test_gemma2_soft_capped_follows_the_plain_loss(table, monkeypatch):
    """Gemma 2's final soft-cap (`ReversibleEmbedding.logit_soft_cap`), its
    table read in half or, as on a CPU without native bfloat16, in float32
    (`KERAS_MP_TIED_HEAD`): the chunks follow the head either way."""
    monkeypatch.setenv("KERAS_MP_TIED_HEAD", table)

    def gemma(chunked_loss, weights=None):
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCABULARY,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=8,
            intermediate_dim=16,
            head_dim=4,
            final_logit_soft_cap=2.0,
        )
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
        return _compiled(model, chunked_loss, weights)

    keras.utils.set_random_seed(2)
    plain = gemma(False)
    chunked = gemma(CHUNK, plain.get_weights())
    for step in range(2):
        got, want = (
            m.train_on_batch(X, Y, sample_weight=SAMPLE_WEIGHT, return_dict=True)
            for m in (chunked, plain)
        )
        # The first step's loss is the same logits'; after it the weights
        # differ by the gradients' roundings (the soft-cap's derivative is
        # float32's here, the plain step's bfloat16's).
        rtol = 1e-5 if step == 0 else 2e-3
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=rtol, err_msg=f"step {step}")
    assert keras_mp.precision_summary(chunked).loss.startswith("float32 loss chunk by chunk")


def _small_lm(chunked_loss=True, metrics=None, head=None):
    tokens = keras.Input((LENGTH,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 8)(tokens)
    hidden = keras.layers.LayerNormalization()(hidden)
    outputs = (head or keras.layers.Dense(VOCABULARY))(hidden)
    model = keras.Model(tokens, outputs)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        amp_level="O2",
        amp_dtype="bfloat16",
        chunked_loss=chunked_loss,
    )
    return model


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "make, reason",
    [
        (
            lambda: _small_lm(metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2)]),
            "plain loss: metric `sparse_top_k_categorical_accuracy` reads the logits",
        ),
        (
            lambda: _small_lm(head=keras.layers.Dense(VOCABULARY, activation="softmax")),
            "plain loss: its output layer `dense",
        ),
        (lambda: _small_lm(chunked_loss=None), "plain loss: logits of 16 tokens x 61 under"),
        (lambda: _small_lm(metrics=["accuracy"]), "float32 loss chunk by chunk through `dense"),
    ],
    ids=["top-k metric", "softmax head", "small logits", "accuracy"],
)
def test_the_step_says_which_loss_it_computes(make, reason):
    model = make()
    model.train_on_batch(IDS, Y)
    assert keras_mp.precision_summary(model).loss.startswith(reason)


@pytest.mark.one_backend
def test_before_the_first_step_the_summary_says_what_decides():
    summary = keras_mp.precision_summary(_small_lm(chunked_loss=None))
    assert summary.loss.startswith("by rule at the first step: float32 loss chunk by chunk")
    assert "Loss: by rule" in summary.text


@pytest.mark.one_backend
def test_a_subclassed_model_keeps_the_plain_loss_and_says_so():
    class LanguageModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.embedding = keras.layers.Embedding(VOCABULARY, 8)
            self.head = keras.layers.Dense(VOCABULARY)

        def call(self, tokens):
            return self.head(self.embedding(tokens))

    model = LanguageModel()
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        amp_level="O2",
        amp_dtype="bfloat16",
        chunked_loss=True,
    )
    model.train_on_batch(IDS, Y)
    assert keras_mp.precision_summary(model).loss.startswith("plain loss: a subclassed model")


@pytest.mark.one_backend
def test_chunked_loss_is_checked():
    with pytest.raises(ValueError, match=r"`chunked_loss` must be .* Received: chunked_loss=0"):
        _small_lm(chunked_loss=0)
    with pytest.raises(ValueError, match="need `amp_level`"):
        keras.Sequential([keras.layers.Dense(2)]).compile(loss="mse", chunked_loss=True)


@pytest.mark.skipif(
    keras.backend.backend() == "jax", reason="JAX's own train_step is a function of the state"
)
def test_a_train_step_of_its_own_calling_compute_loss_is_chunked_when_asked():
    """The user's step, as Keras's guide writes it: `self(x)`,
    `compute_loss`, the compiled metrics; `chunked_loss=True` chunks it, by
    rule it is left plain (it may read the logits)."""

    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data[:2]
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            for metric in self.metrics:
                if metric.name != "loss":
                    metric.update_state(y, y_pred)
            return {"loss": loss}

    def make(chunked_loss):
        return _table_and_head(chunked_loss, 1, OwnStep, optimizer="sgd", metrics=["accuracy"])

    chunked, plain = make(True), make(None)
    losses = [numpy(m.train_on_batch(IDS, Y, return_dict=True)["loss"]) for m in (chunked, plain)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert keras_mp.precision_summary(chunked).loss.startswith("float32 loss chunk by chunk")
    assert keras_mp.precision_summary(plain).loss.startswith("plain loss: your train_step")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's stateless step")
def test_a_jax_train_step_of_its_own_is_chunked_when_asked():
    """Keras's JAX guide's step: `stateless_call`, then `compute_loss`
    outside any scope, then `stateless_apply`. The head's weights are the
    traced values the call that made `y_pred` saw (their gradient, not
    zero; not a second call's); the compiled metrics it cannot update are
    said in the summary."""
    import jax

    class OwnStep(keras.Model):
        def loss_and_updates(self, trainable, non_trainable, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            # A second call, other weights (a teacher's), before the loss.
            zeros = [jax.numpy.zeros_like(v) for v in trainable]
            self.stateless_call(zeros, non_trainable, x)
            return self.compute_loss(x=x, y=y, y_pred=y_pred, training=True), non_trainable

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data[:2]
            grad = jax.value_and_grad(self.loss_and_updates, has_aux=True)
            (loss, non_trainable), grads = grad(trainable, non_trainable, x, y)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable
            )
            state = (trainable, non_trainable, optimizer_variables, metrics_variables)
            return {"loss": loss}, state

    def make(chunked_loss):
        return _table_and_head(chunked_loss, 1, OwnStep, metrics=["accuracy"])

    chunked, plain = make(True), make(False)
    for model in (chunked, plain):
        model.fit(IDS, Y, epochs=2, verbose=0)
    for a, b in zip(chunked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    summary = keras_mp.precision_summary(chunked).loss
    assert summary.startswith("float32 loss chunk by chunk"), summary
    assert "not updated by a JAX train_step of your own" in summary


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow traces a batch of unknown size"
)
def test_a_batch_of_unknown_size_is_chunked_and_said():
    """`fit` on 5 sequences in batches of 2: TensorFlow traces the batch
    dimension as unknown (as for any `tf.data` batched without
    `drop_remainder`): its logits are not known small, so the loss is
    chunked (before: plain, however large the batches), with the known
    tokens as a lower bound in the summary; the steps follow the plain loss."""

    ids = np.concatenate([IDS, IDS, IDS[:1]])
    chunked, plain = _table_and_head(None, 5), _table_and_head(False, 5)
    for model in (chunked, plain):
        model.fit(ids, np.roll(ids, -1, axis=1), batch_size=2, shuffle=False, verbose=0)
    said = keras_mp.precision_summary(chunked).loss
    assert said.startswith("float32 loss chunk by chunk") and f"at least {LENGTH} tokens" in said
    for a, b in zip(chunked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.perf
def test_the_chunked_step_holds_no_tensor_of_the_logits_size(models):
    """The train step's program (JAX's lowered HLO, TensorFlow's traced
    graph with its loops' bodies, PyTorch's tensors of one step): the plain
    loss's holds the logits (16 x 8 tokens x 61), the chunked one's nothing
    that large (a chunk's 5 x 61 logits; the table 61 x 8). Sixteen
    sequences: the logits outgrow every other tensor of the step (JAX's
    finiteness check reads a small model's gradients as one array)."""
    from keras_mp._src.tools import compiled_census

    x = {name: np.tile(value, (8, 1)) for name, value in X.items()}
    y = np.tile(Y, (8, 1))
    logits = y.size * VOCABULARY
    chunked, plain = (compiled_census.largest_tensor(model, x, y) for model in models)
    assert plain >= logits
    assert chunked < logits, (chunked, logits)


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's fit holds no value in the variables"
)
def test_a_lora_head_trains_chunk_by_chunk_on_jax():
    """A LoRA head's kernel is a matmul of its variables, which JAX's `fit`
    holds no value in outside the step's scope: read where the call reads it."""

    chunked, plain = _table_and_head(CHUNK, 6, lora=True), _table_and_head(False, 6, lora=True)
    for model in (chunked, plain):
        model.fit(IDS, Y, epochs=2, verbose=0)
    for a, b in zip(chunked.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
