"""The portable backend hooks (`backends/common.py`): `rounded`, as a cast
rounds, in every compile mode of each backend."""

import functools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_mp._src import backends
from tests.steps import COMPILE_MODES
from tests.steps import compiled
from tests.steps import numpy
from tests.steps import tensor


@functools.lru_cache(maxsize=None)
def _rounded_to(dtype, mode):
    """`rounded` to `dtype`, compiled once per mode: each example below has
    the same shape, so one trace serves them all."""
    return compiled(lambda v: backends.current.rounded(v, dtype), mode)


# Ties (the halfway points between two bfloat16 values, both parities),
# values past the largest bfloat16, subnormals, infinities and NaN.
_ROUNDING = np.array(
    [
        1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.3895314e38, 3.4e38,
        1e-39, -1e-40, 0.0, -0.0, np.inf, -np.inf, np.nan, 0.1, 65519.0, 65520.0, 6e-8,
    ],
    "float32",
)  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", COMPILE_MODES)
@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=40, max_size=40))
def test_rounded_rounds_as_a_cast_does(dtype, mode, values):
    """`rounded`: float32 values rounded to the half dtype, to nearest even,
    as NumPy's cast; the compensated updates keep `x - rounded(x)`."""
    x = np.concatenate([_ROUNDING, np.array(values, "float32")])
    expected = x.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    got = numpy(_rounded_to(dtype, mode)(tensor(x)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected.astype("float32"))
