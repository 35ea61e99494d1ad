"""Keras's softmax, log_softmax and sigmoid in float32 where no layer holds
them: `keras.ops.softmax(x)` in a functional graph, `keras.activations.*`
called in a user's layer and in a subclassed model's `call`, at O2.

Each is compared bit for bit with the same op computed in float32 on the
same half input (read where the model computes it). TensorFlow and JAX
compute a half softmax or sigmoid in half; PyTorch's CPU kernels compute a
float16 one in float32 and round it, the same numbers (where it keeps a
float32 copy for its backward pass), so there a half output rounded to
float16 is what differs.
"""

import re
import threading

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
RNG = np.random.default_rng(0)
X = (RNG.normal(size=(4, 8)) * 4).astype("float32")


def _numpy(x):
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))


def _in_float32(op, x, dtype=None):
    """`op` computed in float32 on `x`, returned in `dtype` (float32)."""
    y = op(keras.ops.cast(x, "float32"))
    return _numpy(y if dtype is None else keras.ops.cast(y, dtype))


def _rules(model):
    """`{name: row}` of the summary; an operation's name without the suffix
    Keras's counter gives it (`softmax_3` where other tests made softmaxes)."""
    rows = {}
    for row in keras_mp.precision_summary(model).rows:
        name = row["layer"].split("/")[-1]
        if row["class"].startswith("ops."):
            name = re.sub(r"_\d+$", "", name)
        rows[name] = row
    return rows


class _Probe(L.Layer):
    """A layer of the user's: notes the inputs it is given."""

    def call(self, x):
        self.seen = x
        return x


@keras.saving.register_keras_serializable("test_probability_ops")
class _Scores(L.Layer):
    """A layer of the user's whose own `call` takes a softmax."""

    def call(self, x):
        self.logits = x
        self.probabilities = keras.activations.softmax(x)
        return keras.ops.sum(self.probabilities * x, axis=-1, keepdims=True)


def _softmax_output_model():
    """`keras.ops.softmax` as an output that another head also reads (so the
    logits' Dense is no output layer and computes in half)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    logits = L.Dense(6, name="logits")(inputs)
    probabilities = keras.ops.softmax(logits)
    return keras.Model(inputs, [probabilities, L.Dense(3, name="other")(probabilities)])


def test_a_graph_s_softmax_output_is_float32_s_and_stays_so_when_reloaded(tmp_path):
    model = _softmax_output_model()
    model.compile(optimizer="sgd", loss=["categorical_crossentropy", "mse"], amp_level="O2")
    logits = keras.Model(model.inputs[0], model.get_layer("logits").output)(X)
    assert keras.backend.standardize_dtype(logits.dtype) == "float16"
    probabilities = model(X)[0]
    want = _in_float32(keras.ops.softmax, logits)
    np.testing.assert_array_equal(_numpy(probabilities), want)
    assert _rules(model)["softmax"]["rule"] == "keras.ops.softmax in float32; returns float32"

    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras", compile=False)
    np.testing.assert_array_equal(_numpy(loaded(X)[0]), want)


def test_a_graph_s_sigmoid_hands_its_float32_numbers_to_half_consumers():
    """`keras.ops.sigmoid` between half layers: computed in float32, handed
    to its float16 consumer in float16 (as a float32 layer there would)."""
    inputs = keras.Input((8,))
    logits = L.Dense(6, name="logits")(inputs)
    gates = keras.ops.sigmoid(logits)
    model = keras.Model(inputs, L.Dense(2, name="out")(_Probe(name="probe")(gates)))
    keras_mp.apply_amp(model, "O2", "float16")
    model(X)
    logits = keras.Model(inputs, logits)(X)
    seen = model.get_layer("probe").seen
    assert keras.backend.standardize_dtype(seen.dtype) == "float16"
    np.testing.assert_array_equal(_numpy(seen), _in_float32(keras.ops.sigmoid, logits, "float16"))
    assert _rules(model)["sigmoid"]["rule"] == (
        f"keras.ops.sigmoid in float32; returns float16 to its float16 consumers in {model.name}"
    )


def _scores_model():
    inputs = keras.Input((8,))
    scores = _Scores(name="scores")(L.Dense(6, name="pre")(inputs))
    # A bounded output: half (no loss given), so that float32 is kept only
    # where a softmax keeps it.
    return keras.Model(inputs, L.Dense(2, activation="sigmoid", name="out")(scores))


def test_your_layer_s_softmax_computes_in_float32_and_returns_its_dtype():
    """`keras.activations.softmax` in a layer of the user's computing in
    float16: float32's probabilities, rounded to the float16 the layer's
    own arithmetic computes in (TensorFlow's raw ops do not promote)."""
    model = _scores_model()
    keras_mp.apply_amp(model, "O2", "float16")
    model(X)
    scores = model.get_layer("scores")
    assert keras.backend.standardize_dtype(scores.probabilities.dtype) == "float16"
    want = _in_float32(keras.ops.softmax, scores.logits, "float16")
    np.testing.assert_array_equal(_numpy(scores.probabilities), want)
    note = keras_mp.precision_summary(model).text.split("\n")[-1]
    assert note.startswith("Softmax, log_softmax and sigmoid of keras.ops and keras.activations")
    assert note.endswith("in the calls of: scores.")


class _Classifier(keras.Model):
    """A subclassed model whose `call` returns its softmax."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = L.Dense(8)
        self.head = L.Dense(6)

    def call(self, x):
        self.logits = self.head(self.hidden(x))
        return keras.ops.softmax(self.logits)


def test_a_subclassed_model_returns_its_softmax_in_float32():
    """At O2 bfloat16 (in float16 its own arithmetic is float32 by rule):
    the probabilities it returns are float32's, not their bfloat16 rounding."""
    model = _Classifier()
    model(X)
    keras_mp.apply_amp(model, "O2", "bfloat16")
    probabilities = model(X)
    assert keras.backend.standardize_dtype(model.logits.dtype) == "bfloat16"
    np.testing.assert_array_equal(
        _numpy(probabilities), _in_float32(keras.ops.softmax, model.logits)
    )


def _input_gradient(model, x):
    """The gradient of `sum(model(x, training=True))` with respect to `x`."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(model(x, training=True))
        return _numpy(tape.gradient(loss, x))
    if backend == "jax":
        import jax

        return _numpy(jax.grad(lambda x: keras.ops.sum(model(x, training=True)))(x))
    import torch

    x = torch.tensor(x, requires_grad=True)
    keras.ops.sum(model(x, training=True)).backward()
    return _numpy(x.grad)


def test_your_layer_s_softmax_trains_keeping_only_its_half_output():
    """In training the softmax of your layer keeps its float16 output for
    the backward pass (its gradient the float32 formula on it), within
    float16's roundings of float32's gradient; on PyTorch no float32 tensor
    of the probabilities' shape is kept (Keras's own CPU softmax keeps one)."""
    keras.utils.set_random_seed(0)
    reference = _scores_model()
    model = _scores_model()
    model.set_weights(reference.get_weights())
    keras_mp.apply_amp(model, "O2", "float16")
    got, want = _input_gradient(model, X), _input_gradient(reference, X)
    assert np.abs(got - want).max() <= 2**-7 * np.abs(want).max()
    if keras.backend.backend() == "torch":
        import torch

        saved = []

        def pack(t):
            saved.append((str(t.dtype).replace("torch.", ""), tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            keras.ops.sum(model(X, training=True))
        assert ("float16", (4, 6)) in saved, saved
        assert ("float32", (4, 6)) not in saved, saved


@pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="PyTorch's CPU softmax of float16 computes in float32: no difference to see",
)
def test_only_a_model_keras_mp_set_computes_so_in_every_thread():
    """The same layer class in a model of Keras's own `mixed_float16` policy,
    called in threads beside the keras_mp model: Keras's half softmax
    there, float32's in the keras_mp model; at O0 the keras_mp model's is
    Keras's again."""
    model = _scores_model()
    keras_mp.apply_amp(model, "O2", "float16")
    keras.config.set_dtype_policy("mixed_float16")
    try:
        plain = _scores_model()
    finally:
        keras.config.set_dtype_policy("float32")
    errors = []

    def calls(model, op):
        try:
            for _ in range(20):
                model(X)
                scores = model.get_layer("scores")
                np.testing.assert_array_equal(
                    _numpy(scores.probabilities), _numpy(op(scores.logits))
                )
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def in_float32(x):
        return keras.ops.cast(keras.ops.softmax(keras.ops.cast(x, "float32")), "float16")

    threads = [
        threading.Thread(target=calls, args=(m, op))
        for m, op in [(model, in_float32), (plain, keras.ops.softmax)] * 2
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    scores = plain.get_layer("scores")  # the two differ on these logits
    assert not np.array_equal(_numpy(scores.probabilities), _numpy(in_float32(scores.logits)))
    keras_mp.apply_amp(model, "O0")
    assert "in the calls of" not in keras_mp.precision_summary(model).text
