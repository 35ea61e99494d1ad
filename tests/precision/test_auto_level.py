"""`amp_level="auto"`: the rule, from the machine's facts."""

import keras
import pytest

import keras_mp
from keras_mp._src.precision import auto_level


@pytest.mark.parametrize(
    "capability, flags, backend, expected",
    [
        ((9, 0), set(), "jax", ("O2", "float16")),
        ((6, 1), set(), "torch", ("O0", "float16")),
        (None, {"avx512_bf16"}, "torch", ("O0", "float16")),
        (None, {"amx_bf16"}, "tensorflow", ("O2", "bfloat16")),
        (None, {"avx512_bf16"}, "jax", ("O0", "float16")),
        (None, set(), "tensorflow", ("O0", "float16")),
    ],
)
def test_auto_level_rule(capability, flags, backend, expected):
    level, dtype, reason = auto_level.auto_level_rule(capability, flags, backend)
    assert (level, dtype) == expected
    assert reason and "RESULTS.md" not in reason


def test_the_machine_gets_a_level_of_the_rule():
    level, dtype, reason = auto_level.pick_auto_level()
    assert level in ("O0", "O2") and dtype in ("float16", "bfloat16") and reason


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
    assert "\nFP8: this machine has no GPU" in keras_mp.precision_summary(model).text
