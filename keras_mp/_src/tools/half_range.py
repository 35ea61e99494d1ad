"""The half dtypes' range, and what a loss scale does to values inside it."""

import math

import numpy as np

# Largest finite value and smallest positive (subnormal) value.
HALF_RANGE = {
    "float16": (65504.0, 2.0**-24),
    "bfloat16": (3.3895313892515355e38, 2.0**-133),
}
# The recommended scale keeps the largest gradient this far below overflow.
_HEADROOM = 2.0
_MAX_RECOMMENDED_SCALE = 2.0**24


def underflow_share(values, scale, dtype="float16"):
    """Share of the non-zero `values` that `dtype` flushes to zero once scaled.

    A value underflows to zero when its scaled magnitude is below half the
    dtype's smallest subnormal (it rounds to 0).
    """
    values = np.abs(np.asarray(values, dtype="float64")).ravel()
    nonzero = values[values > 0]
    if nonzero.size == 0:
        return 0.0
    tiny = HALF_RANGE[dtype][1]
    return float(np.mean(nonzero * scale < tiny / 2))


def overflow_share(values, scale, dtype="float16"):
    """Share of `values` whose scaled magnitude passes `dtype`'s maximum."""
    values = np.abs(np.asarray(values, dtype="float64")).ravel()
    if values.size == 0:
        return 0.0
    return float(np.mean(values * scale > HALF_RANGE[dtype][0]))


def recommended_loss_scale(gradients, dtype="float16"):
    """The largest power of two that keeps every gradient value finite.

    `max|g| * scale` stays a factor `_HEADROOM` below the dtype's maximum,
    so as little as possible underflows without anything overflowing;
    clamped to [1, 2**24]. bfloat16 has float32's range: 1 (no scaling).
    """
    if dtype == "bfloat16":
        return 1.0
    largest = max((float(np.max(np.abs(g))) for g in gradients if np.size(g)), default=0.0)
    if not largest or not math.isfinite(largest):
        return 1.0 if largest else _MAX_RECOMMENDED_SCALE
    exponent = math.floor(math.log2(HALF_RANGE[dtype][0] / (_HEADROOM * largest)))
    return float(min(max(2.0**exponent, 1.0), _MAX_RECOMMENDED_SCALE))
