"""FP8 as a level: `amp_dtype="float8"` at O2 and O3.

Which matmuls the rules put in FP8 (Keras's float8 Dense and EinsumDense,
not the first layer nor the output layer, GEMM dimensions multiples of 16,
`allow=`/`deny=`), the recipe, and every promise: a skipped step keeps the
scales and amax histories, `.keras` reloads and resumes bit for bit,
SavedModel export serves float32, README's custom loop, and training that
follows bfloat16's (KerasHub's Gemma, GPT-2 and BERT, the digits MLP).

The tolerance of "follows": E4M3's unit roundoff, u = 2**-4, is the
relative error of one FP8 rounding. The loss of one batch through FP8
operands is within u of itself unless every rounding error aligns (they are
independent and average out in each sum), and a few steps of training from
the same weights on the same batches keep the two runs within it: at each
step |loss_fp8 - loss_bf16| <= u x loss_bf16. It can fail: over the run
each family's bfloat16 loss falls by more than 2u of itself (asserted), so
an FP8 run whose FP8 layers learned nothing, or computed garbage, leaves
the band. (A bound scaled from bfloat16's distance to float32 by the ratio
of unit roundoffs was tried: bfloat16 tracks float32 too closely on some
families for its gap to measure anything.)
"""

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_mp
from tests.zoo import families

L = keras.layers
BACKEND = keras.backend.backend()
E4M3_ROUNDOFF = 2.0**-4
FP8_REASON = "float8: matmul in FP8"
# These models' matmuls are far too small for FP8 to pay: every one the
# other rules choose goes in FP8 here, to test what FP8 computes.
ANY_SIZE = keras_mp.Float8Recipe(small_gemm=None)


def _mlp():
    """The digits MLP's shape: 64 pixels, 10 classes; one misaligned layer."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            L.Dense(64, activation="relu", name="first"),
            L.Dense(64, activation="relu", name="middle"),
            L.Dense(48, activation="relu", name="narrow"),
            L.Dense(50, activation="relu", name="odd"),
            L.Dense(10, name="head"),
        ]
    )


def _digits(rows=64):
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data[:rows] / 16.0).astype("float32"), digits.target[:rows].astype("int32")


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _rules(model):
    return {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}


def _fp8_layers(model):
    return sorted(
        r["layer"].split("/")[-1]
        for r in keras_mp.precision_summary(model).rows
        if r["policy"].startswith("float8_from_")
    )


def _numpy(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _by_name(variables):
    return {
        "/".join(v.path.split("/")[-2:]): np.array(keras.ops.convert_to_numpy(v)) for v in variables
    }


def _float8_state(model):
    return [w for w in model.weights if "amax_history" in w.path or w.path.endswith("_scale")]


# -- which layers ---------------------------------------------------------------


@pytest.mark.parametrize("level, variables", [("O2", "float32"), ("O3", "bfloat16")])
def test_the_aligned_matmuls_between_the_first_and_the_output_layer_are_fp8(level, variables):
    model = _mlp()
    keras_mp.apply_amp(model, level, "float8", float8_recipe=ANY_SIZE)
    rules = _rules(model)
    assert FP8_REASON in rules["middle"] and FP8_REASON in rules["narrow"], rules
    assert "first layer in bfloat16" in rules["first"]
    assert "units=50 not a multiple of 16" in rules["odd"]
    assert "output layer in bfloat16" in rules["head"]
    policies = {layer.name: layer.dtype_policy for layer in model.layers}
    source = "mixed_bfloat16" if level == "O2" else "bfloat16"
    assert policies["middle"].name == f"float8_from_{source}"
    assert policies["first"].name == policies["odd"].name == source
    assert {layer.kernel.dtype for layer in model.layers} == {variables}
    # Keras's float8 state, in float32 at every level.
    state = _float8_state(model)
    assert len(state) == 12 and {w.dtype for w in state} == {"float32"}
    assert keras.backend.standardize_dtype(model(np.ones((2, 64), "float32")).dtype) == "float32"


def test_allow_puts_first_and_output_layers_in_fp8_and_deny_keeps_float32():
    model = _mlp()
    keras_mp.apply_amp(model, "O2", "float8", allow=["first", "head"], deny=["middle"])
    rules = _rules(model)
    assert FP8_REASON in rules["first"] and FP8_REASON in rules["head"], rules
    assert rules["middle"].startswith("O2: deny=, float32"), rules
    assert model.get_layer("middle").compute_dtype == "float32"


def test_first_layers_are_those_that_take_the_raw_inputs_on_every_path():
    image, extra = keras.Input((4, 8)), keras.Input((16,))
    a = L.Dense(16, name="a")(L.Flatten()(image))
    b = L.Dense(16, name="b")(extra)
    c = L.Dense(32, name="c")(L.Concatenate()([a, b]))
    model = keras.Model([image, extra], L.Dense(16, name="out")(c))
    keras_mp.apply_amp(model, "O3", "float8", float8_recipe=ANY_SIZE)
    rules = _rules(model)
    assert "first layer" in rules["a"] and "first layer" in rules["b"], rules
    assert FP8_REASON in rules["c"] and "output layer" in rules["out"]


def test_only_keras_own_dense_and_einsum_dense_without_lora_compute_in_fp8():
    class MyDense(L.Dense):
        pass

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            L.Dense(32, name="first"),
            MyDense(32, name="mine"),
            L.Dense(32, name="lora"),
            L.EinsumDense("ab,bc->ac", output_shape=32, name="einsum"),
            L.Dense(16, name="head"),
        ]
    )
    model.get_layer("lora").enable_lora(4)
    keras_mp.apply_amp(model, "O2", "float8", float8_recipe=ANY_SIZE)
    assert _fp8_layers(model) == ["einsum"]


def _small_and_wide():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            L.Dense(64, name="first"),
            L.Dense(1040, name="wide"),
            L.Dense(64, name="small"),
            L.Dense(10, name="head"),
        ]
    )


@pytest.mark.one_backend
def test_a_matmul_too_small_for_fp8_to_pay_stays_bfloat16_and_the_summary_names_each():
    """FP8 pays on large GEMMs only (torchao's threshold for tensorwise
    scaling, measured on an H100: 1024 x 2048 x 1024 at 0.80x bfloat16's
    speed, 4096 x 8192 x 16384 at 1.39x): by default a matmul whose
    input_dim is at most 4096 and units at most 1024 stays in bfloat16
    under its reason; `Float8Recipe(small_gemm=None)` and `allow=` put it
    in FP8. `precision_summary` names the FP8 layers and those kept out."""
    model = _small_and_wide()
    keras_mp.apply_amp(model, "O2", "float8")
    rules = _rules(model)
    assert FP8_REASON in rules["wide"], rules
    assert rules["small"] == (
        "O2 float8: input_dim=1040, units=64 too small for FP8 to pay (small_gemm), bfloat16"
    )
    assert model.get_layer("small").dtype_policy.name == "mixed_bfloat16"
    text = keras_mp.precision_summary(model).text.replace(model.name + "/", "")
    assert "\nFP8 matmuls: wide.\n" in text, text
    assert "\nKept out of FP8 (the rule of each above): first, small, head.\n" in text, text
    for amp in ({"float8_recipe": {"small_gemm": None}}, {"allow": ["small"]}):
        model = _small_and_wide()
        keras_mp.apply_amp(model, "O2", "float8", **amp)
        assert FP8_REASON in _rules(model)["small"], amp


class UnbuiltNet(keras.Model):
    """A subclassed model compiled before it is built: its GEMMs' sizes are
    known only when `fit` builds it (input_dim 64, units 16; input_dim 16,
    units 64)."""

    def __init__(self):
        super().__init__()
        self.first = L.Dense(32, name="first")
        self.dense = L.Dense(16, name="dense")
        self.einsum = L.EinsumDense("ab,bc->ac", output_shape=64, name="einsum")
        self.head = L.Dense(4, name="head")

    def call(self, x, training=None):  # `training`: Keras passes it on to the layers
        return self.head(self.einsum(self.dense(keras.ops.tile(self.first(x), (1, 2)))))


def test_an_unbuilt_layers_size_is_decided_when_it_is_built():
    """Under `small_gemm=(32, 16)` neither GEMM is small (each has one
    dimension over), but before `fit` builds the model neither size is
    known: both stay in bfloat16 until then, and are decided when built,
    into FP8 (was: the EinsumDense kept in bfloat16 "unbuilt too small",
    or `fit` failing as a kernel with no value yet was read), and train
    there: their scales move."""
    model = UnbuiltNet()
    model.compile(
        optimizer="sgd",
        loss="mse",
        amp_level="O2",
        amp_dtype="float8",
        float8_recipe=keras_mp.Float8Recipe(small_gemm=(32, 16)),
    )
    assert _rules(model)["einsum"] == (
        "O2 float8: unbuilt: bfloat16 until built, then its GEMM's size decides (small_gemm)"
    )
    x = np.random.default_rng(0).normal(size=(4, 32)).astype("float32")
    model.fit(x, np.zeros((4, 4), "float32"), epochs=1, verbose=0)
    assert _fp8_layers(model) == ["dense", "einsum"], _rules(model)
    assert not any("unbuilt" in rule for rule in _rules(model).values())
    if BACKEND != "jax":  # JAX's step leaves a subclassed model's float8 scales, Keras's own too
        histories = _numpy([model.einsum.inputs_amax_history, model.dense.inputs_amax_history])
        assert all(h.max() > 0 for h in histories), histories


@pytest.mark.one_backend
def test_lora_on_a_layer_in_fp8_is_refused_at_compile_by_name():
    """`enable_lora` on a layer already in FP8 failed at the first step of
    `fit` with Keras's "`_float8_call` doesn't support LoRA"; `compile`
    now refuses it, naming the layer and the order that works."""
    model = _mlp()
    compiled = dict(optimizer="sgd", loss=_loss(), amp_level="O2", amp_dtype="float8")
    model.compile(**compiled, float8_recipe=ANY_SIZE)
    assert "middle" in _fp8_layers(model)
    model.get_layer("middle").enable_lora(2)
    with pytest.raises(ValueError, match=r"Layer 'middle' computes in FP8 .*`enable_lora` before"):
        model.compile(**compiled, float8_recipe=ANY_SIZE)


# -- the recipe and bad input ----------------------------------------------------


def test_a_frozen_layer_computes_in_bfloat16_and_says_why():
    """Issue 63.4: Keras's float8 layers move their scales only through the
    optimizer, so a frozen one (a frozen base, the layers `enable_lora`
    leaves alone) would compute with its scales stuck at 1."""
    model = _mlp()
    model.layers[1].trainable = False
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    frozen, trained = model.layers[1], model.layers[2]
    assert frozen.dtype_policy.name == "mixed_bfloat16"
    assert _rules(model)[frozen.name] == (
        "O2 float8: frozen (FP8 scales move only in training), bfloat16"
    )
    assert trained.dtype_policy.quantization_mode == "float8"


def test_a_trained_model_in_fp8_starts_from_its_kernels_amax():
    """Issue 63.4: `apply_amp(model, "O2", "float8")` on trained weights of
    a pretrained model's scale (std 3e-3): before any step the FP8 layer's
    kernel scale is its own amax over E4M3's maximum, not 1 (with 1, most of
    the kernel rounded to 0: relative error 0.31 against float32)."""
    rng = np.random.default_rng(0)
    reference = _mlp()
    reference.set_weights(
        [rng.normal(scale=3e-3, size=w.shape).astype("float32") for w in reference.get_weights()]
    )
    model = _mlp()
    model.set_weights(reference.get_weights())
    keras_mp.apply_amp(model, "O2", "float8", float8_recipe=ANY_SIZE)
    assert "middle" in _fp8_layers(model)
    layer = model.get_layer("middle")
    kernel_amax = np.abs(reference.get_layer("middle").get_weights()[0]).max()
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(layer.kernel_scale), kernel_amax / 448.0, rtol=1e-6
    )
    x = rng.normal(size=(32, 64)).astype("float32")
    inner = keras.Model(model.inputs, model.get_layer("middle").output)
    want = keras.Model(reference.inputs, reference.get_layer("middle").output)(x)
    got = keras.ops.convert_to_numpy(inner(x)).astype("float32")
    want = keras.ops.convert_to_numpy(want)
    # E4M3 keeps 3 bits of mantissa: a relative error per value of 2**-4.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2**-4


def test_the_output_layer_behind_weightless_layers_stays_out_of_fp8():
    """Issue 63.5: a Dense followed by `Activation("softmax")`, and a
    subclassed model's last Dense, are the model's output layers."""
    inputs = keras.Input((64,))
    x = keras.layers.Dense(64, name="first")(inputs)
    x = keras.layers.Dense(64, name="middle")(x)
    x = keras.layers.Dense(16, name="head")(x)
    model = keras.Model(inputs, keras.layers.Activation("softmax")(x))
    keras_mp.apply_amp(model, "O2", "float8", float8_recipe=ANY_SIZE)
    assert model.get_layer("head").dtype_policy.name == "mixed_bfloat16"
    assert model.get_layer("middle").dtype_policy.quantization_mode == "float8"

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(64)
            self.b = keras.layers.Dense(64)
            self.c = keras.layers.Dense(16)

        def call(self, x):
            return self.c(self.b(self.a(x)))

    net = Net()
    net(np.zeros((2, 64), "float32"))
    keras_mp.apply_amp(net, "O2", "float8", float8_recipe=ANY_SIZE)
    assert net.c.dtype_policy.name == "mixed_bfloat16"
    assert net.b.dtype_policy.quantization_mode == "float8"


def test_the_recipe_sets_the_amax_history_and_is_saved(tmp_path):
    model = _mlp()
    x, y = _digits()
    model.compile(
        optimizer="adam",
        loss=_loss(),
        amp_level="O2",
        amp_dtype="float8",
        float8_recipe=keras_mp.Float8Recipe(amax_history_length=16, small_gemm=None),
    )
    assert model.get_layer("middle").inputs_amax_history.shape == (16,)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.get_layer("middle").dtype_policy.amax_history_length == 16
    assert loaded.get_compile_config()["float8_recipe"]["amax_history_length"] == 16


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_float8_needs_o2_or_o3(level):
    with pytest.raises(ValueError, match=rf"needs `amp_level` to be one of O2, O3.*'{level}'"):
        _mlp().compile(optimizer="adam", loss="mse", amp_level=level, amp_dtype="float8")
    with pytest.raises(ValueError, match="needs `amp_level` to be 'O2' or 'O3'.*'auto'"):
        _mlp().compile(optimizer="adam", loss="mse", amp_level="auto", amp_dtype="float8")
    with pytest.raises(ValueError, match="`float8_recipe` needs `dtype='float8'`"):
        keras_mp.apply_amp(_mlp(), "O2", "bfloat16", float8_recipe={"amax_history_length": 4})


@settings(max_examples=25, deadline=None)
@given(
    st.one_of(
        st.integers(max_value=0),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=3),
    )
)
def test_a_bad_amax_history_length_is_refused_by_name(length):
    with pytest.raises(ValueError, match=r"`amax_history_length` must be an integer of at least 1"):
        keras_mp.Float8Recipe(amax_history_length=length)


@pytest.mark.parametrize(
    "recipe, match",
    [
        ({"fp8_format": "e4m3"}, "`fp8_format` must be one of 'hybrid'"),
        ({"margin": 1}, "`margin` must be one of 0"),
        ({"amax_compute_algo": "most_recent"}, "`amax_compute_algo` must be one of 'max'"),
        ({"history": 4}, r"unknown keys \['history'\]"),
        ({"small_gemm": (16,)}, r"`small_gemm` must be None or a pair .*\(16,\)"),
        ("hybrid", "`float8_recipe` must be a `keras_mp.Float8Recipe`"),
    ],
)
def test_recipes_keras_float8_layers_cannot_compute_are_refused_by_name(recipe, match):
    with pytest.raises((ValueError, TypeError), match=match):
        keras_mp.apply_amp(_mlp(), "O2", "float8", float8_recipe=recipe)


# -- every promise -----------------------------------------------------------------


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_non_finite_step_keeps_weights_slots_scales_and_amax_histories(level):
    model = _mlp()
    x, y = _digits(32)
    model.compile(
        optimizer="adam", loss=_loss(), amp_level=level, amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)  # histories and slots not trivial
    history = np.array(keras.ops.convert_to_numpy(model.get_layer("middle").inputs_amax_history))
    assert np.count_nonzero(history) == 2, history  # one amax a step
    before = _numpy(model.weights) + _numpy(model.optimizer.variables)
    bad = x.copy()
    bad[0, 0] = np.nan
    model.fit(bad, y, batch_size=32, epochs=1, verbose=0)
    after = _numpy(model.weights) + _numpy(model.optimizer.variables)
    paths = [v.path for v in list(model.weights) + list(model.optimizer.variables)]
    changed = [
        path for path, b, a in zip(paths, before, after) if not np.array_equal(b, a, equal_nan=True)
    ]
    # The skip's own count, and the good steps in a row (reset): nothing else.
    assert [p.split("/")[-1] for p in changed] == ["good_steps", "skipped_steps"], changed
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # trains on, finite
    assert all(np.isfinite(w).all() for w in _numpy(model.weights))


def test_reload_and_resume_are_bit_exact(tmp_path):
    model = _mlp()
    x, y = _digits()
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O3", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert _fp8_layers(loaded) == _fp8_layers(model) == ["middle", "narrow"]
    for m in (model, loaded):
        m.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    # By layer and name: a layer built under Keras's float8 policy (loaded)
    # creates its scales before its kernel; one quantized when built, after.
    trained, resumed = _by_name(model.weights), _by_name(loaded.weights)
    assert trained.keys() == resumed.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="SavedModel is written from TensorFlow")
def test_savedmodel_export_serves_float32(tmp_path):
    import tensorflow as tf

    model = _mlp()
    x, y = _digits()
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    expected = model.predict(x, verbose=0)
    model.export(str(tmp_path / "as_trained"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "as_trained"))
    out = served.serve(tf.constant(x))
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy(), expected)  # what it computes, as trained
    # A float32 copy computes without FP8: a float32 twin's forward pass.
    keras_mp.export(model, str(tmp_path / "float32"), verbose=False)
    twin = _mlp()
    weights = [w for w in model.weights if w.path.endswith(("kernel", "bias"))]
    twin.set_weights(_numpy(weights))
    served32 = tf.saved_model.load(str(tmp_path / "float32"))
    np.testing.assert_allclose(served32.serve(tf.constant(x)).numpy(), twin(x), atol=1e-5)


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="the float32 copy is the same code on every backend; JAX's ONNX route "
    "(40 s through jax2tf) is test_export_formats.py's",
)
def test_onnx_serves_an_fp8_model_as_a_float32_copy(tmp_path):
    """ONNX runs no bfloat16 (README's table): an FP8 model, bfloat16 around
    its FP8 matmuls, is served as its float32 copy, a float32 twin's
    forward pass, by onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    model = _mlp()
    x, y = _digits()
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    # A few steps: scales and amax histories of its own, not the initial ones.
    model.fit(x[:128], y[:128], batch_size=32, epochs=1, verbose=0)
    path = str(tmp_path / "model.onnx")
    model.export(path, format="onnx", verbose=False)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (served,) = session.run(None, {session.get_inputs()[0].name: x})
    twin = _mlp()
    twin.set_weights(_numpy(w for w in model.weights if w.path.endswith(("kernel", "bias"))))
    assert served.dtype == np.float32
    np.testing.assert_allclose(served, keras.ops.convert_to_numpy(twin(x)), atol=1e-5)


def _readme_loop(model, optimizer, loss_fn):
    """README's custom loop of this backend, returning `run_step(x, y)`."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def train_step(x, y):
            with optimizer.restore_on_skip(model):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                    scaled_loss = optimizer.scale_loss(loss)
                grads = tape.gradient(scaled_loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)
            return loss

        return train_step
    if BACKEND == "torch":

        def train_step(x, y):
            with optimizer.restore_on_skip(model):
                loss = loss_fn(y, model(x, training=True))
                model.zero_grad()
                optimizer.scale_loss(loss).backward()
                grads = [v.value.grad for v in model.trainable_variables]
                optimizer.apply(grads, model.trainable_variables)
            return loss

        return train_step
    import jax

    def compute_loss(trainable, non_trainable, optimizer_values, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        loss = loss_fn(y, y_pred)
        with keras.StatelessScope(state_mapping=zip(optimizer.variables, optimizer_values)):
            scaled_loss = optimizer.scale_loss(loss)
        return scaled_loss, (loss, non_trainable)

    @jax.jit
    def jax_step(state, x, y):
        trainable, non_trainable, optimizer_values = state
        grads, (loss, new_non_trainable) = jax.grad(compute_loss, has_aux=True)(
            trainable, non_trainable, optimizer_values, x, y
        )
        trainable, optimizer_values, non_trainable = optimizer.stateless_apply(
            optimizer_values,
            grads,
            trainable,
            non_trainable_variables=(non_trainable, new_non_trainable),
        )
        return loss, (trainable, non_trainable, optimizer_values)

    groups = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    state = [[v.value for v in group] for group in groups]

    def run_step(x, y):
        loss, new_state = jax_step(state, x, y)
        state[:] = new_state
        for group, values in zip(groups, new_state):
            for variable, value in zip(group, values):
                variable.assign(value)
        return loss

    return run_step


def test_readmes_custom_loop_skips_a_non_finite_step_with_its_fp8_state():
    model = _mlp()
    keras_mp.apply_amp(model, "O2", "float8", float8_recipe=ANY_SIZE)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    optimizer.build(model.trainable_variables)
    run_step = _readme_loop(model, optimizer, _loss())
    x, y = _digits(32)
    first = float(keras.ops.convert_to_numpy(run_step(x, y)))
    run_step(x, y)
    before = _numpy(model.weights)
    bad = x.copy()
    bad[3, 3] = np.inf
    run_step(bad, y)
    for a, b in zip(before, _numpy(model.weights)):
        np.testing.assert_array_equal(a, b)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 1
    for _ in range(3):
        last = float(keras.ops.convert_to_numpy(run_step(x, y)))
    assert last < first
    history = keras.ops.convert_to_numpy(model.get_layer("middle").outputs_grad_amax_history)
    assert np.isfinite(history).all() and history.max() > 0


# -- training follows bfloat16's -------------------------------------------------------


def digits():
    x, y = _digits(256)
    return _mlp(), x, y


FAMILIES = {**families.FP8, "digits": digits}
STEPS = 8


def _losses(family, **amp):
    keras.utils.set_random_seed(0)
    model, x, y = FAMILIES[family]()[:3]
    model.compile(optimizer=keras.optimizers.Adam(5e-3), loss=_loss(), **amp)
    batch = len(y)  # one batch a step, the same each step
    history = model.fit(x, y, batch_size=batch, epochs=STEPS, shuffle=False, verbose=0)
    return model, np.array(history.history["loss"])


@pytest.mark.zoo
@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_at_o2_float8_follows_o2_bfloat16(family):
    # CI's time: the KerasHub families train on PyTorch (about a second each,
    # 20-50 s compiled on a CPU), the MLP on every backend, compiled on
    # TensorFlow and JAX (the census checks every family's FP8 matmuls in
    # each backend's compiled step).
    if family in families.FP8 and BACKEND != "torch":
        pytest.skip(f"{family} trains on PyTorch (CI's time)")
    _, bf16 = _losses(family, amp_level="O2", amp_dtype="bfloat16")
    model, fp8 = _losses(family, amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE)
    chosen = [r for r in keras_mp.precision_summary(model).rows if FP8_REASON in r["rule"]]
    kinds = {r["class"] for r in chosen}
    assert kinds == ({"Dense"} if family == "digits" else {"Dense", "EinsumDense"}) or (
        family == "gemma" and kinds == {"EinsumDense"}
    ), kinds
    assert bf16[-1] < (1 - 2 * E4M3_ROUNDOFF) * bf16[0], bf16  # the band can be left
    assert np.all(np.abs(fp8 - bf16) <= E4M3_ROUNDOFF * bf16), (fp8, bf16)


def test_a_layer_frozen_after_fp8_training_follows_its_inputs_amax():
    """Keras cannot undo a quantization: a layer trained in FP8 and frozen
    since stays FP8 on the next compile. Keras moves its scales only through
    the optimizer; fine-tuning the rest on inputs ten times larger left its
    input scale where training had, saturating E4M3 (a relative error of
    0.76 against float32; review of issue 63). Its input scale now follows
    each training step's amax: the error is E4M3's again."""
    model = _mlp()
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    x, y = _digits(64)
    model.fit(x, y, epochs=1, verbose=0)
    middle = model.get_layer("middle")
    middle.trainable = False
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    assert _rules(model)["middle"] == (
        "O2 float8: frozen after FP8 training, its input scale follows each step's amax"
    )
    kernel = keras.ops.convert_to_numpy(middle.kernel)
    model.fit(10.0 * x, y, epochs=1, verbose=0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(middle.kernel), kernel)
    first = model.get_layer("first")
    inputs = keras.ops.convert_to_numpy(keras.ops.cast(first(10.0 * x[:32]), "float32"))
    got = keras.ops.convert_to_numpy(keras.ops.cast(middle(inputs), "float32"))
    want = np.maximum(inputs @ kernel + keras.ops.convert_to_numpy(middle.bias), 0.0)
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()
    # Trained again, it is Keras's own FP8 layer, its scales the optimizer's.
    middle.trainable = True
    model.compile(
        optimizer="adam", loss=_loss(), amp_level="O2", amp_dtype="float8", float8_recipe=ANY_SIZE
    )
    assert _rules(model)["middle"].startswith("O2 " + FP8_REASON)
