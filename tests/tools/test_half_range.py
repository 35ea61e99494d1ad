"""The half dtypes' range: what share of values a loss scale flushes to zero
or to inf, and the scale the doctor recommends, against direct computations."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_mp._src.tools import half_range

pytestmark = pytest.mark.one_backend

KNOWN = np.array([1e-12, 1e-10, 3e-9, 2e-8, 1e-6, 1e-3, 0.5, 100.0], "float32")


def direct_underflow(values, scale):
    """float16 rounds a value below half its smallest subnormal (2**-24) to 0."""
    values = np.abs(values.astype("float64"))
    values = values[values > 0]
    return np.mean(values * scale < 2.0**-25)


@pytest.mark.parametrize(
    "values, scale", [(KNOWN, 1.0), (KNOWN * 1e-3, 2.0**15), (np.zeros(3), 4.0)]
)
def test_share_functions(values, scale):
    assert half_range.underflow_share(values, scale) == pytest.approx(
        direct_underflow(values, scale) if np.any(values) else 0.0
    )
    expected_overflow = np.mean(np.abs(values.astype("float64")) * scale > 65504)
    assert half_range.overflow_share(values, scale) == pytest.approx(expected_overflow)


@given(st.floats(1e-6, 1e4), st.sampled_from([2.0**k for k in range(0, 25)]))
def test_shares_agree_with_casting_to_float16(value, scale):
    """A value flushed to zero, or to inf, by the scale is exactly one that
    float16 itself turns into 0 or inf."""
    scaled = np.float64(value) * scale
    as_half = np.float16(scaled)
    assert half_range.overflow_share([value], scale) == float(np.isinf(as_half))
    if scaled < 2.0**-25 or scaled > 2.0**-24:  # away from the rounding tie
        assert half_range.underflow_share([value], scale) == float(as_half == 0)


def test_recommended_scale_keeps_the_largest_gradient_below_overflow():
    # max |g| = 100: 65504 / (2 * 100) = 327.5 -> 2**8.
    assert half_range.recommended_loss_scale([KNOWN]) == 2.0**8
    assert np.isfinite(np.float16(100.0 * half_range.recommended_loss_scale([KNOWN])))
    assert half_range.recommended_loss_scale([KNOWN], "bfloat16") == 1.0
    assert half_range.recommended_loss_scale([np.zeros(3)]) == 2.0**24  # nothing to fear
    assert half_range.recommended_loss_scale([np.array([1e6])]) == 1.0  # clamped at 1
