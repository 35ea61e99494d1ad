"""The boundary rule: the dtype a layer returns to its caller, and a model's
float32 inputs and outputs."""

import functools

import keras
import numpy as np
import pytest

import keras_mp


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_subclassed_model_inputs_and_outputs_are_float32(level):
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4)
            self.logits = keras.layers.Dense(2)

        def call(self, x):
            return {"logits": self.logits(self.hidden(x)), "hidden": self.hidden(x)}

    model = Net()
    keras_mp.apply_amp(model, level, "bfloat16")
    keras_mp.apply_amp(model, level, "bfloat16")  # idempotent: one cast, not two
    assert model.logits.compute_dtype == "bfloat16"
    assert model.dtype_policy.name == "float32" and model.input_dtype == "float32"
    outputs = model(np.ones((2, 3), "float32"))
    assert {k: keras.backend.standardize_dtype(v.dtype) for k, v in outputs.items()} == {
        "logits": "float32",
        "hidden": "float32",
    }
    rule = keras_mp.precision_summary(model).rows[0]["rule"]
    assert rule == f"{level}: model, float32 inputs and outputs"


def test_boundary_rule_gives_the_caller_one_dtype():
    """A composite layer adding its sublayers' outputs: float32 LayerNorm in
    a float16 block (O2), float16 Dense in a float32 block (O1)."""

    @keras.saving.register_keras_serializable(package="keras_mp_tests")
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(8)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return x + self.norm(x) + self.dense(x)  # raw arithmetic on both

    model = keras.Sequential([keras.Input((8,)), Block(name="block"), keras.layers.Dense(2)])
    for level, block_dtype in [("O1", "float32"), ("O2", "float32"), ("O3", "float16")]:
        keras_mp.apply_amp(model, level, allow=[] if level != "O2" else None)
        block = model.get_layer("block")
        assert block.compute_dtype == block_dtype, level
        out = block(np.ones((2, 8), "float32"))
        assert keras.backend.standardize_dtype(out.dtype) == block_dtype
    # Opted into half at O2: LayerNorm (float32) returns float16 to it.
    keras_mp.apply_amp(model, "O2", allow=[Block])
    assert block.compute_dtype == "float16" and block.norm.compute_dtype == "float32"
    out = block(np.ones((2, 8), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    rows = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert any("returns float16 to block" in rule for rule in rows.values())


# -- what a user's train_step receives -------------------------------------------


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@pytest.mark.parametrize(
    "level, dtype",
    [("O2", "float16"), ("O2", "bfloat16"), ("O3", "float16"), ("O3", "bfloat16")],
)
def test_what_a_models_own_code_calls_returns_float32_in_both_half_dtypes(level, dtype):
    """One rule for float16 and bfloat16: a layer or model that a subclassed
    model holds returns float32 when the model's own code (its
    `train_step`, `compute_loss`) calls it, and the dtype of the model's
    `call` inside it. Before, DDIM's normalizer returned bfloat16 to its
    `train_step` (and float32 in float16), a half Dense its half dtype."""

    class Holder(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.normalizer = keras.layers.Normalization()
            self.dense = keras.layers.Dense(4)
            self.inner = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(3)])
            self.seen = {}

        def call(self, x):
            normalized = self.normalizer(x)
            hidden = self.dense(normalized)
            self.seen = {"normalizer": _dtype(normalized), "dense": _dtype(hidden)}
            return self.inner(hidden)

    model = Holder()
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    model.normalizer.adapt(x)
    model(x)
    keras_mp.apply_amp(model, level, dtype)
    assert model.dense.compute_dtype == dtype
    assert _dtype(model(x)) == "float32"
    # Inside `call`: its own dtype (at O2 in float16 a model of the user's
    # runs its own arithmetic in float32, its layers in half).
    inside = "float32" if (level, dtype) == ("O2", "float16") else dtype
    assert model.seen == {"normalizer": inside, "dense": inside}
    for held in (model.normalizer, model.dense, model.inner):  # outside it
        assert _dtype(held(x if held is not model.inner else np.ones((4, 4), "float32"))) == (
            "float32"
        ), held.name


def _ddim_fit(**amp):
    """keras-io's DDIM, 3 epochs: the model, its noise losses, what was said."""
    import warnings

    from tests import keras_io

    model, x = keras_io.ddim()
    keras_io.compile_ddim(model, **amp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, epochs=3, batch_size=keras_io.DDIM_BATCH, verbose=0)
    return model, history.history["n_loss"], [str(w.message) for w in caught]


@functools.lru_cache(maxsize=None)
def _ddim_o0_losses():
    return tuple(_ddim_fit()[1])


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="keras-io's DDIM: TensorFlow")
@pytest.mark.parametrize(
    "level, dtype", [("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")]
)
def test_ddim_trains_as_written_in_both_half_dtypes(level, dtype):
    """keras-io's DDIM calls `self.normalizer(images)` and its network
    (whose sinusoidal-embedding `Lambda` mixes its input with a float32
    `tf.linspace`) from `train_step`. Before, at O2/O3 in bfloat16 the
    normalizer gave bfloat16 to `signal_rates * images` ("Input 'y' of
    'Mul' Op has type bfloat16 that does not match type float32"), and at
    O2 in float16 the Lambda failed the same way. Now the normalizer returns
    float32 to the step, the Lambda computes in float32 (named once), and
    the losses follow the O0 float32 run's."""

    reference = _ddim_o0_losses()
    model, losses, told = _ddim_fit(amp_level=level, amp_dtype=dtype)
    (embedding,) = [
        layer for layer in model.network.layers if isinstance(layer, keras.layers.Lambda)
    ]
    assert any(f"layer {embedding.name!r} (Lambda) cannot compute in {dtype}" in t for t in told)
    assert f"deny=[{embedding.name!r}]" in " ".join(told)
    # The network's Lambda (its EMA clone's, of the same name, never ran).
    rows = [r for r in keras_mp.precision_summary(model).rows if r["class"] == "Lambda"]
    assert [r["compute_dtype"] for r in rows] == ["float32", dtype], rows
    assert f"mixes {dtype} with float32 in its own call: float32" in rows[0]["rule"]
    np.testing.assert_allclose(losses, reference, rtol=0.03)


# -- feature extractors: every layer an output ---------------------------------------


@pytest.mark.parametrize("level, dtype", [("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")])
def test_a_feature_extractor_computes_in_half_and_returns_float32(level, dtype):
    """keras-io's neural style transfer: `keras.Model(inputs, outputs_dict)`
    with every layer of VGG19 an output. Before, "model output: float32"
    made every layer float32: nothing ran in half. Now an output that other
    layers take in computes as the level says (precision_summary shows the
    convolutions in half) and leaves the model in float32; the last layer
    computes as its level says too (a pooling: float32 at O1, off the
    allow-list) and returns float32. The features follow O0's."""
    from tests import keras_io

    reference = keras_io.feature_extractor()
    extractor = keras_io.feature_extractor()
    keras_mp.apply_amp(extractor, level, dtype)
    rows = {row["layer"].split("/")[-1]: row for row in keras_mp.precision_summary(extractor).rows}
    for name in ("block1_conv1", "block2_conv1", "block3_conv1"):
        assert rows[name]["compute_dtype"] == dtype, rows[name]
    # The layers that make the last output (its pooling and the convolution
    # before it): no loss says what their values hold, and nothing bounds
    # them, so in float16 they are float32 (the head rule); in bfloat16 half.
    head = "model output (no loss keras_mp knows): float16 could overflow it"
    for name in ("block3_conv2", "block3_pool"):
        row = rows[name]
        if dtype == "float16":
            assert row["compute_dtype"] == "float32" and row["rule"].startswith(head), row
        else:
            assert row["compute_dtype"] == dtype, row
    if dtype != "float16":
        assert "model output: returns float32" in rows["block3_pool"]["rule"]
    base, style = keras_io.style_transfer_images()
    want, got = reference(base), extractor(base)
    for name, feature in got.items():
        assert _dtype(feature) == "float32", name
        scale = np.abs(keras.ops.convert_to_numpy(want[name])).max() + 1e-6
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(feature) / scale,
            keras.ops.convert_to_numpy(want[name]) / scale,
            atol=3e-2 if dtype == "bfloat16" else 5e-3,
            err_msg=name,
        )


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="keras-io's loop: TensorFlow")
@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_neural_style_transfer_runs_its_loop_on_half_features(level, dtype):
    """keras-io's loop as written (`tf.function` around a GradientTape, SGD
    on the image) over the half feature extractor: its loss follows the
    float32 extractor's."""
    import tensorflow as tf

    from tests import keras_io

    def run(level):
        extractor = keras_io.feature_extractor()
        if level != "O0":
            keras_mp.apply_amp(extractor, level, dtype)
        base, style = keras_io.style_transfer_images()

        @tf.function
        def compute_loss_and_grads(combination_image, base_image, style_reference_image):
            with tf.GradientTape() as tape:
                loss = keras_io.style_transfer_loss(
                    extractor, combination_image, base_image, style_reference_image
                )
            grads = tape.gradient(loss, combination_image)
            return loss, grads

        optimizer = keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(
                initial_learning_rate=100.0, decay_steps=100, decay_rate=0.96
            )
        )
        combination_image = tf.Variable(base)
        losses = []
        for _ in range(10):
            loss, grads = compute_loss_and_grads(combination_image, base, style)
            optimizer.apply_gradients([(grads, combination_image)])
            losses.append(float(loss))
        return losses

    reference = run("O0")
    losses = run(level)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, reference, rtol=0.05)


# -- the model's output layers ---------------------------------------------------


def _softmax_head(**amp):
    """Dense(3, softmax) whose logits are 0, -25 and 25 for an input of ones:
    class 1's probability, e^-50 = 2e-22, is 0 in float16 and bfloat16."""
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(3, activation="softmax", name="head")]
    )
    model.get_layer("head").set_weights(
        [np.array([[0.0, -12.5, 12.5]] * 2, "float32"), np.zeros(3, "float32")]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", **amp)
    return model


@pytest.mark.parametrize("level, dtype", [("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")])
def test_a_softmax_head_computes_its_matmul_in_half_and_its_probabilities_in_float32(level, dtype):
    """The output layer's matmul in half, its softmax after a cast to float32:
    a probability of 2e-22 survives (in half it is 0), the loss is O0's (on
    TensorFlow 50, from the softmax's logits, not the 16.1 of a clipped 0),
    and the layer's config keeps its own activation."""
    x, y = np.ones((4, 2), "float32"), np.ones((4,), "int32")
    reference = _softmax_head().evaluate(x, y, verbose=0)
    model = _softmax_head(amp_level=level, amp_dtype=dtype)
    head = model.get_layer("head")
    assert head.compute_dtype == dtype
    row = keras_mp.precision_summary(model).rows[-1]
    assert "model output: returns float32; softmax in float32" in row["rule"], row
    probs = model(x)
    assert _dtype(probs) == "float32"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(probs)[0, 1], np.exp(-50.0), rtol=1e-2)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), reference, rtol=1e-3)
    assert head.get_config()["activation"] == "softmax"


@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_output_layers_follow_allow_and_deny(level, dtype):
    """deny= keeps an output layer float32, as before the output rule;
    allow= puts a layer of your own at the output in half."""

    class Scale(keras.layers.Layer):  # your own output layer
        def call(self, x):
            return x * 2.0

    def model():
        inputs = keras.Input((4,))
        x = keras.layers.Dense(4, name="head")(inputs)
        return keras.Model(inputs, [x, Scale(name="scale")(inputs)])

    rows = keras_mp.precision_summary(keras_mp.apply_amp(model(), level, dtype)).rows
    rows = {r["layer"].split("/")[-1]: r for r in rows}
    # No loss given: in float16 the head's outputs may overflow (float32);
    # allow= puts it in half.
    assert rows["head"]["compute_dtype"] == ("float32" if dtype == "float16" else dtype)
    allowed = keras_mp.apply_amp(model(), level, dtype, allow=["head"])
    assert allowed.get_layer("head").compute_dtype == dtype
    assert rows["scale"]["compute_dtype"] == "float32"
    assert rows["scale"]["rule"] == "model output: your layer, float32 (allow= for half)"
    denied = keras_mp.apply_amp(model(), level, dtype, deny=["head"], allow=["scale"])
    rows = {r["layer"].split("/")[-1]: r for r in keras_mp.precision_summary(denied).rows}
    assert rows["head"]["compute_dtype"] == "float32"
    assert rows["scale"]["compute_dtype"] == dtype
    for output in denied(np.ones((2, 4), "float32")):
        assert _dtype(output) == "float32"


def _tied_language_model(policy="float32"):
    """KerasHub's causal LM in small: a backbone embeds the tokens, the model
    multiplies its output by the same table (`reverse=True`)."""
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        table = keras.layers.ReversibleEmbedding(32, 8, name="token_embedding")
        tokens = keras.Input((6,), dtype="int32")
        backbone = keras.Model(tokens, keras.layers.Dense(8, name="block")(table(tokens)))
        return keras.Model(tokens, table(backbone(tokens), reverse=True))
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.perf
@pytest.mark.parametrize("form", ["half", "float32"])
def test_a_tied_head_reads_its_table_as_the_device_multiplies(form, monkeypatch):
    """On a CPU without native bfloat16 (`KERAS_MP_TIED_HEAD` unset) the
    tied head's table is read in float32: the program multiplies it in
    float32, and on TensorFlow and PyTorch its logits are Keras's
    `mixed_bfloat16` logits, bit for bit (Keras's JAX policy reads the table
    in bfloat16, under the model's autocast scope). Elsewhere in bfloat16
    (the tests pin "half", `tests/conftest.py`)."""
    from keras_mp._src.tools import compiled_census

    monkeypatch.setenv("KERAS_MP_TIED_HEAD", form)
    model = _tied_language_model()
    keras_reference = _tied_language_model("mixed_bfloat16")
    keras_reference.set_weights(model.get_weights())
    model.compile("adam", "sparse_categorical_crossentropy", amp_level="O2", amp_dtype="bfloat16")
    x = np.random.default_rng(0).integers(0, 32, (4, 6)).astype("int32")
    y = np.random.default_rng(1).integers(0, 32, (4, 6)).astype("int32")
    (head,) = [r for r in keras_mp.precision_summary(model).rows if r["layer"] == "token_embedding"]
    census = compiled_census.census(model, x, y)
    if form == "float32":
        assert "its weights read in float32 on this CPU" in head["rule"], head
        assert census.flops.get("float32", 0) > 0, census
        if keras.backend.backend() != "jax":
            expected = np.asarray(keras_reference.predict(x, verbose=0), "float32")
            np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
        # A table the layer casts itself (`reverse_dtype`) is said as it is.
        own = _tied_language_model()
        own.get_layer("token_embedding").reverse_dtype = "bfloat16"
        own.compile("adam", "sparse_categorical_crossentropy", amp_level="O2", amp_dtype="bfloat16")
        (row,) = [
            r for r in keras_mp.precision_summary(own).rows if r["layer"] == "token_embedding"
        ]
        assert "read in float32" not in row["rule"], row
        # O3's table is bfloat16 itself: read as stored, and said so.
        half_table = _tied_language_model()
        half_table.compile(
            "adam", "sparse_categorical_crossentropy", amp_level="O3", amp_dtype="bfloat16"
        )
        (row,) = [
            r
            for r in keras_mp.precision_summary(half_table).rows
            if r["layer"] == "token_embedding"
        ]
        assert "read in float32" not in row["rule"], row
    else:
        assert "read in float32" not in head["rule"], head
        assert census.half_share == 1.0, census


def test_a_bad_tied_head_form_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setenv("KERAS_MP_TIED_HEAD", "bf16")
    model = _tied_language_model()
    optimizer = keras.optimizers.Adam()
    with pytest.raises(ValueError, match="KERAS_MP_TIED_HEAD must be one of .*Received: 'bf16'"):
        model.compile(optimizer, "sparse_categorical_crossentropy", amp_level="O2")
    with pytest.raises(ValueError, match="KERAS_MP_TIED_HEAD must be one of .*Received: 'bf16'"):
        keras_mp.apply_amp(model, "O2", "bfloat16")
    assert model.get_layer("token_embedding").dtype_policy.name == "float32"
    assert not model.compiled
