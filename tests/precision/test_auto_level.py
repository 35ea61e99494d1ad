"""`amp_level="auto"`: the rule, from the machine's facts."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src import backends
from keras_mp._src.backends import cpu_rates
from keras_mp._src.backends import gpu_peaks
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import auto_level
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_time

FAST = {"float32": 200e9, "bfloat16": 660e9}  # oneDNN with AVX512-BF16 (issue 64)
XLA = {"float32": 225e9, "bfloat16": 323e9}  # JAX's CPU emitter on that CPU
EMULATED = {"float32": 150e9, "bfloat16": 1.3e9}  # PyTorch without native bfloat16
EVEN = {"float32": 150e9, "bfloat16": 160e9}
L = keras.layers


def _cpu(rates):
    """A CPU with native bfloat16, its matmuls at `rates`; its launches
    and elementwise ops as this 2-core Xeon's proxy measured them with
    TensorFlow (O0, O2 bfloat16): the same at both dtypes per value."""
    return gpu_peaks.Peaks(
        "a CPU with AVX512-BF16",
        float16=rates["float32"],
        bfloat16=rates["bfloat16"],
        tf32=None,
        float32=rates["float32"],
        bandwidth=20e9,
        kind="cpu",
        native=("bfloat16",),
        launch={"float32": 30e-6, "bfloat16": 45e-6},
        elementwise={"float32": 1e9, "bfloat16": 1e9},
    )


def _digits_mlp():
    """The main job's MLP (examples/train_mixed_precision.py)."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            L.Dense(256, activation="relu"),
            L.BatchNormalization(),
            L.Dense(256, activation="relu"),
            L.Dense(10, activation="softmax"),
        ]
    )


def _gpt2_block():
    """A GPT-2 block at the benchmark's size (hidden 512, 8 heads, 2048
    wide, 128 tokens) and its 8192-word logits."""
    inputs = keras.Input((128, 512))
    x = L.MultiHeadAttention(8, 64)(inputs, inputs, use_causal_mask=True)
    x = L.LayerNormalization()(L.Add()([inputs, x]))
    y = L.Dense(512)(L.Dense(2048, activation="gelu")(x))
    x = L.LayerNormalization()(L.Add()([x, y]))
    return keras.Model(inputs, L.Dense(8192)(x))


def _predicted(model, batch, rates):
    """The model's step at O0 and O2 bfloat16 on `_cpu(rates)`."""
    x = keras.KerasTensor((batch,) + tuple(model.inputs[0].shape[1:]), "float32")
    o0, o2 = (amp_settings.for_layers(level, "bfloat16") for level in ("O0", "O2"))
    return step_time.predict(model, speed_trace.trace(model, x), o0, o2, _cpu(rates))


@pytest.fixture(scope="module")
def steps():
    """The digits MLP (batch 32) and the GPT-2 block (batch 16) at 2.5x and
    at XLA's 1.4x bfloat16 matmul rates, predicted once for the module."""
    skip_unless_torch()
    mlp, block = _digits_mlp(), _gpt2_block()
    native = {"float32": 200e9, "bfloat16": 500e9}
    return {
        "mlp": _predicted(mlp, 32, native),
        "block": _predicted(block, 16, native),
        "block, XLA": _predicted(block, 16, XLA),
    }


def skip_unless_torch():
    if keras.backend.backend() != "torch":
        pytest.skip("the rule's decision does not depend on the backend: PyTorch checks it")


@pytest.mark.parametrize(
    "capability, flags, backend, rates, step, expected",
    [
        ((9, 0), set(), "jax", None, None, ("O2", "float16")),
        ((6, 1), set(), "torch", None, None, ("O0", "float16")),
        (None, {"avx512_bf16"}, "torch", FAST, "block", ("O2", "bfloat16")),
        (None, {"amx_bf16"}, "tensorflow", FAST, "block", ("O2", "bfloat16")),
        (None, {"avx512_bf16"}, "jax", XLA, "block, XLA", ("O2", "bfloat16")),
        # A 64-wide MLP's step is its launches: O2's casts add to them.
        (None, {"avx512_bf16"}, "torch", FAST, "mlp", ("O0", "float16")),
        # No model to predict: a fast matmul alone does not decide.
        (None, {"avx512_bf16"}, "jax", FAST, None, ("O0", "float16")),
        (None, {"avx2"}, "torch", EMULATED, None, ("O0", "float16")),
        # No native instructions: a fast timing is noise (a 1024 matmul's
        # float32 rate varied 78-142 GFLOP/s between processes on a Zen 3).
        (None, {"avx2"}, "tensorflow", FAST, "block", ("O0", "float16")),
        # Flags unknown (no /proc/cpuinfo): the timings decide.
        (None, set(), "jax", FAST, "block", ("O2", "bfloat16")),
        (None, {"neon", "bf16"}, "torch", FAST, "block", ("O2", "bfloat16")),
        (None, {"avx2"}, "tensorflow", None, None, ("O0", "float16")),
    ],
)
def test_auto_level_rule(capability, flags, backend, rates, step, expected, steps):
    """Issue 64: on a CPU the measured rates decide, not the flags; issue
    75: and the model's predicted step, not a matmul alone."""
    step = steps[step] if step else None
    level, dtype, reason = auto_level.auto_level_rule(capability, flags, backend, rates, step=step)
    assert (level, dtype) == expected
    assert reason and "RESULTS.md" not in reason
    native = sorted(set(flags) & {"avx512_bf16", "amx_bf16", "bf16"})
    if capability is not None:
        return
    if flags and not native:
        assert "no native bfloat16" in reason and "converted to float32" in reason
    elif rates:
        speedup = rates["bfloat16"] / rates["float32"]
        assert f"{speedup:.2f}x float32's rate" in reason and backend in reason
        assert (
            f"native bfloat16 ({', '.join(native)})" in reason
            if native
            else ("flags unknown" in reason)
        )
        if step is None:
            assert "no model was given to predict its step" in reason
        else:
            assert f"predicted at {step.speedup:.2f}x O0's speed" in reason


def test_a_small_step_is_its_launches_and_a_large_one_its_matmuls(steps):
    """Issue 75.5: the digits MLP, whose bfloat16 matmul runs 2.5x float32's,
    is predicted slower at O2 (its launches and their casts), as measured on
    a CPU with AVX512-BF16 (0.65-0.77x); the GPT-2 block faster, and less
    so at XLA's 1.4x (JAX's GPT-2 measured 1.17x)."""
    mlp, block, xla = steps["mlp"], steps["block"], steps["block, XLA"]
    assert mlp.speedup < 0.9 and mlp.at_level.launch_bound and not mlp.o0.launch_bound
    assert mlp.at_level.launches > mlp.o0.launches  # the casts
    assert mlp.at_level.matmuls < mlp.o0.matmuls / 2  # the matmuls alone would pay
    assert block.speedup > xla.speedup >= auto_level.CPU_MIN_STEP_SPEEDUP
    assert not block.at_level.launch_bound and block.o0.matmuls > 2 * block.o0.other
    # The explanation names the numbers it decides on.
    text = mlp.explain()
    assert f"{mlp.o0.launches} -> {mlp.at_level.launches} launches" in text
    assert "its launches take longer than its work" in text


def test_a_step_slower_at_o2_on_a_gpu_keeps_o0_and_says_why(steps):
    """On a GPU too, never a level predicted slower than O0: the digits
    MLP's step, its launches (0.7x), keeps O0 and says why; the GPT-2
    block gets O2 in float16."""
    mlp = steps["mlp"]
    mlp = step_time.Prediction("O2", "float16", mlp.o0, mlp.at_level)
    assert mlp.speedup < 1.0
    level, dtype, reason = auto_level.auto_level_rule((9, 0), set(), "jax", step=mlp)
    assert level == "O0"
    assert "tensor cores" in reason and "would slow this step" in reason
    assert f"predicted at {mlp.speedup:.2f}x O0's speed" in reason
    level, dtype, reason = auto_level.auto_level_rule((9, 0), set(), "jax", step=steps["block"])
    assert (level, dtype) == ("O2", "float16") and "would slow" not in reason


def test_a_step_that_could_not_be_predicted_keeps_o0_and_says_why():
    why = "its inputs are not known at compile (build it on a batch first)"
    level, _, reason = auto_level.auto_level_rule(None, {"amx_bf16"}, "torch", FAST, step=why)
    assert level == "O0" and why in reason and "3.30x float32's rate" in reason


def test_auto_with_a_named_dtype_judges_that_dtype(steps):
    """`amp_dtype="float16"` with `auto` on a CPU with native bfloat16 only:
    float16 is emulated there, so O0, not bfloat16's O2 applied to float16."""
    rates = {"float32": 200e9, "float16": 20e9}
    level, dtype, reason = auto_level.auto_level_rule(
        None, {"avx512_bf16"}, "tensorflow", rates, "float16"
    )
    assert level == "O0" and "no native float16" in reason
    fp16 = {"float32": 200e9, "float16": 900e9}
    level, dtype, reason = auto_level.auto_level_rule(
        None, {"amx_fp16"}, "jax", fp16, "float16", step=steps["block"]
    )
    assert (level, dtype) == ("O2", "float16") and "4.50x" in reason
    # Keras's PyTorch backend multiplies float16 in float32 on a CPU.
    level, _, reason = auto_level.auto_level_rule(
        None, {"amx_fp16"}, "torch", fp16, "float16", computes_half=False
    )
    assert level == "O0" and "multiplies float16 in float32" in reason
    # A GPU without bfloat16 tensor cores (a T4, 7.5) and bfloat16 named.
    level, _, reason = auto_level.auto_level_rule((7, 5), set(), "jax", None, "bfloat16")
    assert level == "O0" and "without bfloat16 tensor cores" in reason
    assert auto_level.auto_level_rule((8, 0), set(), "jax", None, "bfloat16")[0] == "O2"


def test_the_machine_gets_a_level_of_the_rule():
    level, dtype, reason = auto_level.pick_auto_level()
    assert level in ("O0", "O2") and dtype in ("float16", "bfloat16") and reason


def test_auto_says_what_it_picked_in_precision_summary():
    """Issue 64.1: the reason of `auto` is in `precision_summary`, and a
    later named level replaces it."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse", amp_level="auto")
    level, dtype, reason = auto_level.pick_auto_level()
    text = keras_mp.precision_summary(model).text
    assert f"amp_level='auto' picked {level}" in text and reason in text
    model.compile(optimizer="adam", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    assert "amp_level='auto'" not in keras_mp.precision_summary(model).text
    model.compile(optimizer="adam", loss="mse", amp_level="auto")
    keras_mp.to_float(model, "bfloat16")
    assert "amp_level='auto'" not in keras_mp.precision_summary(model).text
    model.compile(optimizer="adam", loss="mse", amp_level="auto")
    keras_mp.to_float(model.layers[0], "bfloat16")  # a layer inside
    assert "amp_level='auto'" not in keras_mp.precision_summary(model).text


class Unbuilt(keras.Model):
    """A subclassed model, not built at `compile`."""

    def __init__(self):
        super().__init__()
        self.hidden = L.Dense(16, activation="relu")
        self.out = L.Dense(10)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("build", [_digits_mlp, Unbuilt], ids=["built", "unbuilt"])
def test_auto_on_this_machine_trains_and_explains_itself(build):
    """Issue 75.5, end to end on this machine: `compile(amp_level="auto")`
    of a built model and of one not built yet trains, and says why in
    `precision_summary`; a CPU's O2 rests on the model's predicted step."""
    model = build()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss, amp_level="auto")
    x, y = np.random.default_rng(0).random((8, 64), "float32"), np.arange(8) % 10
    assert np.isfinite(model.train_on_batch(x, y))
    text = keras_mp.precision_summary(model).text
    level = model.get_compile_config()["amp_level"]
    assert f"amp_level='auto' picked {level}" in text
    flags = cpu_rates.cpu_flags()
    if backends.current.gpu_compute_capability() is None:
        if flags and not cpu_rates.native(flags, "bfloat16"):
            assert "no native bfloat16" in text and level == "O0"
        elif level == "O2":
            assert "is predicted at" in text


def test_float8_says_where_no_fp8_matmul_runs():
    """Issue 63.7: on a CPU, and on GPUs without FP8 tensor cores, FP8
    brings no speed (FP8 GEMMs in software on JAX and PyTorch, Keras's
    quantize-dequantize around bfloat16 matmuls on TensorFlow): said once,
    with what the machine has, and in `precision_summary`. On a GPU with
    FP8 units JAX's dots take FP8 operands: nothing to say there."""
    from keras_mp._src.precision.auto_level import float8_rule

    cpu = float8_rule(None, {"avx512_bf16", "avx2"}, "torch")
    assert "no GPU" in cpu and "avx512_bf16" in cpu and "FP8 brings no speed here" in cpu
    assert "FP8 GEMMs" in cpu and "slower than amp_dtype='bfloat16'" in cpu
    assert "multiply in bfloat16" in float8_rule(None, set(), "tensorflow")
    assert "compute capability 8.0" in float8_rule((8, 0), set(), "tensorflow")
    assert float8_rule((9, 0), set(), "tensorflow") is None
    assert float8_rule((9, 0), set(), "jax") is None
    model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(3)])
    keras_mp.apply_amp(model, "O2", "float8", float8_recipe={"small_gemm": None})
    text = keras_mp.precision_summary(model).text
    # The machine's own line: a CPU's, or a GPU's before Ada.
    assert "\nFP8: " in text
    if backends.current.gpu_compute_capability() is None:
        assert "\nFP8: this machine has no GPU" in text
    # TensorFlow multiplies no FP8 operands: its FP8 is quantize-dequantize.
    qdq = "\nFP8: on tensorflow, FP8 is quantize-dequantize" in text
    assert qdq == (keras.backend.backend() == "tensorflow"), text
