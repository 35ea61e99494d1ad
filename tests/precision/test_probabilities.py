"""Probabilities in float32 wherever they are computed (issue 63.2, 63.3).

A `Dense(2, activation="softmax")` whose float32 probabilities are
(1, 2.06e-9): in float16 the second rounds to 0. It must come out as
float32's wherever the layer sits (a Sequential, a nested model, before a
`Reshape`, feeding another head too, inside a subclassed model), at every
half level, and its config and saved file stay the user's, with threads
calling the model.
"""

import threading

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
SMALL = float(np.exp(-20.0) / (1.0 + np.exp(-20.0)))  # 2.06e-9: 0 in float16


def _head(name="head"):
    # Logits (10, -10) for an input of 1.
    return L.Dense(
        2,
        activation="softmax",
        name=name,
        kernel_initializer=keras.initializers.Constant([[10.0, -10.0]]),
        bias_initializer="zeros",
    )


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = L.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
        self.head = _head()

    def call(self, x):
        return self.head(self.hidden(x))


def _sequential():
    return keras.Sequential([keras.Input((1,)), _head()])


def _nested():
    return keras.Sequential([keras.Input((1,)), keras.Sequential([_head()])])


def _reshaped():
    inputs = keras.Input((1,))
    return keras.Model(inputs, L.Reshape((2, 1))(_head()(inputs)))


def _two_heads():
    inputs = keras.Input((1,))
    probs = _head()(inputs)
    return keras.Model(inputs, [probs, L.Dense(3, name="other")(probs)])


SHAPES = {
    "sequential": _sequential,
    "nested": _nested,
    "reshaped": _reshaped,
    "two_heads": _two_heads,
    "subclassed": _Subclassed,
}


def _probabilities(model):
    out = model(np.ones((1, 1), "float32"))
    probs = keras.tree.flatten(out)[0]
    assert keras.backend.standardize_dtype(probs.dtype) == "float32"
    return keras.ops.convert_to_numpy(probs).reshape(-1)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_softmax_keeps_float32_probabilities_wherever_it_sits(shape, level):
    model = SHAPES[shape]()
    keras_mp.apply_amp(model, level, "float16")
    probs = _probabilities(model)
    np.testing.assert_allclose(probs, [1.0, SMALL], rtol=1e-3)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_softmax_and_sigmoid_layers_are_float32_inside_the_model(level):
    """A `Softmax` and an `Activation("sigmoid")` between half layers: float32
    at every level, O3 too."""
    inputs = keras.Input((4,))
    x = L.Dense(4, name="d1")(inputs)
    x = L.Softmax(name="softmax")(x)
    x = L.Activation("sigmoid", name="sigmoid")(L.Dense(4, name="d2")(x))
    model = keras.Model(inputs, L.Dense(3, name="out")(x))
    keras_mp.apply_amp(model, level, "float16")
    assert model.get_layer("softmax").compute_dtype == "float32"
    assert model.get_layer("sigmoid").compute_dtype == "float32"
    assert model.get_layer("d2").compute_dtype == "float16"


def test_threads_leave_the_layer_and_its_file_as_the_user_made_them(tmp_path):
    """Four threads calling the model 100 times each: the activation is the
    user's (by name) in the config and the saved file, which loads and
    predicts as the model does."""
    model = _sequential()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", amp_level="O2")
    x = np.ones((1, 1), "float32")
    errors = []

    def calls():
        try:
            for _ in range(100):
                np.testing.assert_allclose(
                    keras.ops.convert_to_numpy(model(x))[0], [1.0, SMALL], rtol=1e-3
                )
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    head = model.get_layer("head")
    assert head.get_config()["activation"] == "softmax"
    assert head.activation.__name__ == "softmax"
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.get_layer("head").get_config()["activation"] == "softmax"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x))
    )


def test_o0_gives_the_user_s_activation_back():
    model = _sequential()
    activation = model.get_layer("head").activation
    keras_mp.apply_amp(model, "O2")
    assert model.get_layer("head").activation is not activation  # float32 form
    keras_mp.apply_amp(model, "O0")
    assert model.get_layer("head").activation is activation


def test_data_movement_passes_on_the_dtype_it_receives():
    """A `Flatten` after a half layer stays half (memory as Keras's policy);
    after a float32 probability it stays float32."""
    inputs = keras.Input((2, 2))
    half = L.Flatten(name="after_half")(L.Dense(2, name="dense")(inputs))
    probs = L.Flatten(name="after_probs")(L.Dense(2, activation="softmax", name="sm")(inputs))
    model = keras.Model(inputs, [L.Dense(2, name="a")(half), L.Dense(2, name="b")(probs)])
    keras_mp.apply_amp(model, "O2", "float16")
    probe = keras.Model(
        model.inputs, [model.get_layer("after_half").output, model.get_layer("after_probs").output]
    )
    got = probe(np.ones((1, 2, 2), "float32"))
    assert [keras.backend.standardize_dtype(t.dtype) for t in got] == ["float16", "float32"]


def _classifier_losses_at_o2_bfloat16(layer, shape):
    """`layer` under a 3-class logits head, compiled at O2 bfloat16: the
    losses of one epoch on 8 random examples of `shape`."""
    inputs = keras.Input(shape)
    model = keras.Model(inputs, L.Dense(3)(layer(inputs)))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        amp_level="O2",
        amp_dtype="bfloat16",
    )
    x = np.random.default_rng(0).random((8, *shape)).astype("float32")
    return model.fit(x, np.arange(8) % 3, epochs=1, verbose=0).history["loss"]


def test_recurrent_layers_keep_their_sigmoid_as_they_compute_it():
    """A recurrent layer's `activation` is its cell's (a read-only property),
    and a cell's feeds the state it carries in its own dtype: both are left
    as they are (review of issue 63: `compile` failed, or the scan's carry
    changed dtype)."""
    for make in (
        lambda: L.SimpleRNN(8, activation="sigmoid"),
        lambda: L.GRU(8, activation="sigmoid"),
        lambda: L.LSTM(8, activation="sigmoid"),
        lambda: L.RNN(L.SimpleRNNCell(8, activation="sigmoid")),
    ):
        assert np.isfinite(_classifier_losses_at_o2_bfloat16(make(), (5, 4))).all()


def test_a_gate_inside_your_block_gets_its_own_dtype():
    """`value(x) * gate(x)` with a sigmoid gate, in a block of the user's at
    O2 bfloat16: the gate's float32 probabilities come back in the block's
    dtype (TensorFlow's raw `*` does not promote)."""

    class Gated(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.value = L.Dense(8)
            self.gate = L.Dense(8, activation="sigmoid")

        def call(self, x):
            return self.value(x) * self.gate(x)

    assert np.isfinite(_classifier_losses_at_o2_bfloat16(Gated(), (4,))).all()


# -- an attention's probabilities: float32 arithmetic, half kept (issue 65) ----


def _attention_model():
    """keras-io's text classification with a Transformer: its block's
    `MultiHeadAttention`, whose `Softmax` is float32 at every level and
    hands its probabilities to the half matmul with the values."""
    inputs = keras.Input((6, 8))
    attention = L.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")
    # Its scores asked for: the softmax, not the fused attention op.
    x, _ = attention(inputs, inputs, return_attention_scores=True)
    return keras.Model(inputs, L.Dense(3, name="out")(L.GlobalAveragePooling1D()(x)))


def _saved_dtypes(model, x):
    """The dtypes (and shapes) of the tensors PyTorch's autograd saves for a
    forward pass."""
    import torch

    saved = []

    def pack(t):
        saved.append((str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        keras.ops.sum(model(x, training=True))
    return saved


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_an_attention_keeps_its_probabilities_in_half_with_float32_gradients(half):
    """The softmax's forward values are float32's rounded to half, as its
    consumer reads them; its gradient is the float32 formula on the kept half
    probabilities (within a few half roundings of float32's); on PyTorch no
    float32 tensor of the probabilities' shape is kept for the backward pass."""
    if keras.backend.backend() == "jax" and half == "float16":
        pytest.skip("attention computes in float32 on JAX's CPU (no float16 dot there)")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    keras.utils.set_random_seed(0)
    reference = _attention_model()
    model = _attention_model()
    model.set_weights(reference.get_weights())
    keras_mp.apply_amp(model, "O2", half)
    softmax = model.get_layer("attention")._softmax
    assert softmax.compute_dtype == "float32"
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert f"kept in {half} for the backward pass" in " ".join(rules.values()), rules

    scores = keras.ops.convert_to_tensor(rng.normal(size=(2, 2, 6, 6)).astype(half))
    probabilities = softmax(scores)
    assert keras.backend.standardize_dtype(probabilities.dtype) == half
    want = keras.ops.softmax(keras.ops.cast(scores, "float32"), axis=-1)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(probabilities, "float32")),
        keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(want, half), "float32")),
    )
    got = _gradients(model, x)
    expected = _gradients(reference, x)
    spacing = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[half]
    # Against the largest gradient: the keys' are about 0 (a sum of softmax
    # outputs does not depend on them), and their half errors are noise.
    scale = max(np.abs(e).max() for e in expected)
    for g, e in zip(got, expected):
        assert np.abs(g - e).max() / scale < 8 * spacing
    if keras.backend.backend() == "torch":
        saved = _saved_dtypes(model, x)
        assert (half, (2, 2, 6, 6)) in saved, saved
        assert ("float32", (2, 2, 6, 6)) not in saved, saved


def _gradients(model, x):
    """The gradients of `sum(model(x))` with respect to the trainable
    variables, as float64 NumPy arrays."""
    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x, training=True), "float32"))
        grads = tape.gradient(loss, variables)
    elif backend == "jax":
        import jax

        def loss_of(values):
            y, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables], x)
            return keras.ops.sum(keras.ops.cast(y, "float32"))

        grads = jax.grad(loss_of)([v.value for v in variables])
    else:
        for v in variables:
            v.value.grad = None
        keras.ops.sum(keras.ops.cast(model(x, training=True), "float32")).backward()
        grads = [v.value.grad for v in variables]
    return [
        keras.ops.convert_to_numpy(keras.ops.cast(g, "float32")).astype("float64") for g in grads
    ]


def _input_gradient(model, x):
    """The gradient of `sum(model(x, training=True))` with respect to `x`,
    as a float64 NumPy array."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(model(x, training=True), "float32"))
        grad = tape.gradient(loss, x)
    elif backend == "jax":
        import jax

        grad = jax.grad(lambda x: keras.ops.sum(model(x, training=True)))(x)
    else:
        import torch

        x = torch.tensor(x, requires_grad=True)
        keras.ops.sum(model(x, training=True)).backward()
        grad = x.grad
    return keras.ops.convert_to_numpy(grad).astype("float64")


def test_a_kept_softmax_passes_tiny_float16_gradients_on_exactly():
    """The backward pass of a softmax kept in float16 reads the upstream
    gradient as it is, float16's subnormals too (2**-20 here: a rounding of
    it to float16's own exponent would flush it to zero): the float32
    formula on the kept half probabilities, to float32's rounding."""
    inputs = keras.Input((4,))
    probabilities = L.Softmax(name="softmax")(inputs)
    tiny = np.array([[1.0], [-3.0], [2.0], [5.0]]) * 2.0**-20
    hidden = L.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(tiny))
    out = L.Dense(1, use_bias=False, kernel_initializer="ones", name="out")
    model = keras.Model(inputs, out(hidden(probabilities)))
    keras_mp.apply_amp(model, "O2", "float16")
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert "kept in float16 for the backward pass" in rules["softmax"], rules
    x = np.array([[0.5, -1.0, 2.0, 0.25], [3.0, 0.0, -2.0, 1.0]], "float32")

    got = _input_gradient(model, x)
    z = np.exp(x - x.max(-1, keepdims=True))
    kept = (z / z.sum(-1, keepdims=True)).astype("float16").astype("float64")
    w = tiny.reshape(-1)
    want = kept * (w - (kept * w).sum(-1, keepdims=True))
    assert np.abs(want).min() > 0
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2.0**-40)


class _TemperatureSoftmax(L.Softmax):
    """A user's softmax with a temperature: `softmax(x / 4)`."""

    def call(self, inputs, mask=None):
        return super().call(inputs / 4.0, mask=mask)


def test_a_softmax_subclass_keeps_its_own_gradient():
    """A subclass of `Softmax` with a `call` of its own is not Keras's
    softmax: its backward pass is autodiff's, not `y * (g - sum(g * y))`
    on its output (which drops the temperature's 1/4), and the summary says
    nothing is kept. Its gradient is the float32 model's within bfloat16's
    roundings."""

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        x = _TemperatureSoftmax(name="softmax")(L.Dense(4, name="pre")(inputs))
        return keras.Model(inputs, L.Dense(1, name="out")(L.Dense(3)(x)))

    reference, model = build(), build()
    keras_mp.apply_amp(model, "O2", "bfloat16")
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert "kept" not in rules["softmax"], rules
    x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    got, want = _input_gradient(model, x), _input_gradient(reference, x)
    assert np.abs(got - want).max() <= 2**-6 * np.abs(want).max(), (got, want)
