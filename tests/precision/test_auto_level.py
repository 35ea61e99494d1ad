"""`amp_level="auto"`: the rule, from the machine's facts."""

import pytest

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
