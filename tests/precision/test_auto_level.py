"""`amp_level="auto"`: the rule, from the machine's facts."""

import keras
import pytest

import keras_mp
from keras_mp._src import backends
from keras_mp._src.precision import auto_level

FAST = {"float32": 200e9, "bfloat16": 660e9}  # oneDNN with AVX512-BF16 (issue 64)
XLA = {"float32": 225e9, "bfloat16": 323e9}  # JAX's CPU emitter on that CPU
EMULATED = {"float32": 150e9, "bfloat16": 1.3e9}  # PyTorch without native bfloat16
EVEN = {"float32": 150e9, "bfloat16": 160e9}


@pytest.mark.parametrize(
    "capability, flags, backend, rates, expected",
    [
        ((9, 0), set(), "jax", None, ("O2", "float16")),
        ((6, 1), set(), "torch", None, ("O0", "float16")),
        (None, {"avx512_bf16"}, "torch", FAST, ("O2", "bfloat16")),
        (None, {"amx_bf16"}, "tensorflow", FAST, ("O2", "bfloat16")),
        (None, {"avx512_bf16"}, "jax", XLA, ("O2", "bfloat16")),
        (None, {"avx512_bf16"}, "jax", EVEN, ("O0", "float16")),
        (None, {"avx2"}, "torch", EMULATED, ("O0", "float16")),
        # No native instructions: a fast timing is noise (a 1024 matmul's
        # float32 rate varied 78-142 GFLOP/s between processes on a Zen 3).
        (None, {"avx2"}, "tensorflow", FAST, ("O0", "float16")),
        # Flags unknown (no /proc/cpuinfo): the timing decides.
        (None, set(), "jax", FAST, ("O2", "bfloat16")),
        (None, {"neon", "bf16"}, "torch", FAST, ("O2", "bfloat16")),
        (None, {"avx2"}, "tensorflow", None, ("O0", "float16")),
    ],
)
def test_auto_level_rule(capability, flags, backend, rates, expected):
    """Issue 64: on a CPU the measured matmul rates decide, not the flags."""
    level, dtype, reason = auto_level.auto_level_rule(capability, flags, backend, rates)
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


def test_auto_with_a_named_dtype_judges_that_dtype():
    """`amp_dtype="float16"` with `auto` on a CPU with native bfloat16 only:
    float16 is emulated there, so O0, not bfloat16's O2 applied to float16."""
    rates = {"float32": 200e9, "float16": 20e9}
    level, dtype, reason = auto_level.auto_level_rule(
        None, {"avx512_bf16"}, "tensorflow", rates, "float16"
    )
    assert level == "O0" and "no native float16" in reason
    fp16 = {"float32": 200e9, "float16": 900e9}
    level, dtype, reason = auto_level.auto_level_rule(None, {"amx_fp16"}, "jax", fp16, "float16")
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


def test_float8_says_where_no_fp8_matmul_runs():
    """Issue 63.7: on a CPU, and on GPUs without FP8 tensor cores, Keras's
    float8 layers multiply in bfloat16: said once, with what the machine
    has, and in `precision_summary`."""
    from keras_mp._src.precision.auto_level import float8_rule

    cpu = float8_rule(None, {"avx512_bf16", "avx2"}, "torch")
    assert "no GPU" in cpu and "avx512_bf16" in cpu and "slower than amp_dtype='bfloat16'" in cpu
    assert "compute capability 8.0" in float8_rule((8, 0), set(), "tensorflow")
    assert float8_rule((9, 0), set(), "tensorflow") is None
    assert "did not rewrite" in float8_rule((9, 0), set(), "jax")
    model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(3)])
    keras_mp.apply_amp(model, "O2", "float8")
    text = keras_mp.precision_summary(model).text
    # The machine's own line: a CPU's, or a GPU's (e.g. JAX on an H100: XLA
    # did not rewrite the layers).
    assert "\nFP8: " in text
    if backends.current.gpu_compute_capability() is None:
        assert "\nFP8: this machine has no GPU" in text
