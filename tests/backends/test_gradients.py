"""The gradients' checks (`backends/gradients.py`): the finiteness check,
exact on every dtype, and unscaling in float32; run on every backend."""

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from keras import ops

import keras_mp
from keras_mp._src import backends
from tests.steps import COMPILE_MODES
from tests.steps import SCALED_BY_HAND
from tests.steps import compiled
from tests.steps import numpy
from tests.steps import tensor

pytestmark = SCALED_BY_HAND


_SHAPES = [(), (0,), (3,), (1, 5), (4, 3), (2, 3, 2), (3, 3, 2, 4)]


@st.composite
def _gradient_lists(draw):
    dtype = draw(st.sampled_from(["float32", "float16"]))
    big = np.finfo(dtype).max
    grads = []
    for shape in draw(st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=4)):
        size = int(np.prod(shape))
        values = draw(
            st.lists(
                st.one_of(
                    st.floats(-4.0, 4.0, width=16),
                    st.sampled_from([np.inf, -np.inf, np.nan, big, -big]),
                ),
                min_size=size,
                max_size=size,
            )
        )
        grads.append(np.asarray(values, dtype).reshape(shape))
    return grads


@pytest.mark.parametrize(
    "grads, expected",
    [
        ([[1.0, 2.0], [3.0]], True),
        ([[3e38, 3e38], [3e38]], True),  # the sum overflows, the values do not
        ([[1.0, np.inf], [3.0]], False),
        ([[1.0, 2.0], [-np.inf]], False),
        ([[np.nan, 2.0], [3.0]], False),
        ([[np.inf, -np.inf], [3.0]], False),  # the sum would be nan anyway
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_all_finite_is_exact(grads, expected, dtype, mode):
    """bfloat16 has float32's range: its float32 sums overflow as float32's do."""
    if dtype == "float16":
        grads = [[min(v, 6e4) if np.isfinite(v) else v for v in g] for g in grads]
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    tensors = [tensor(g, dtype) for g in grads] + [None]
    check = compiled(backends.current.all_finite, COMPILE_MODES[-1] if mode == "compiled" else mode)
    assert bool(numpy(check(tensors))) is expected


@pytest.mark.parametrize("size", [4095, 4096, 5000, 1 << 20])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_all_finite_finds_one_nan_in_a_large_gradient(size, dtype, mode):
    """A layer's gradient has thousands of values: one nan among them, first,
    in the middle or last, is found (XLA's CPU max and min of 4096 or more
    float32 values drop a nan, openxla/xla#21461)."""
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    check = compiled(backends.current.all_finite, COMPILE_MODES[-1] if mode == "compiled" else mode)

    def grads(nan_at=None):
        values = np.ones(size, np.float32)
        if nan_at is not None:
            values[nan_at] = np.nan
        return [
            tensor(np.ones((3, 4)), dtype),
            tensor(values.reshape(-1, 8 if size % 8 == 0 else 1), dtype),
        ]

    # The same shapes each time: one trace.
    for where in (0, size // 2, size - 1):
        assert not bool(numpy(check(grads(where)))), (size, where)
    assert bool(numpy(check(grads())))


def test_all_finite_mixed_dtypes():
    grads = [tensor([1.0], "float16"), tensor([np.inf], "float32")]
    assert not bool(numpy(backends.current.all_finite(grads)))
    grads = [tensor([np.inf], "float16"), tensor([1.0], "float32")]
    assert not bool(numpy(backends.current.all_finite(grads)))


@pytest.mark.parametrize("mode", COMPILE_MODES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(grads=_gradient_lists())
# The sum of finite values overflows: still finite (the exact check decides).
@example(grads=[np.full((4, 3), np.finfo("float32").max, "float32")])
@example(grads=[np.full((2, 3, 2), -3e38, "float32"), np.full((3,), 3e38, "float32")])
@example(grads=[np.full((4, 3), 3e38, "float32"), np.array([1.0, np.nan], "float32")])
def test_all_finite_matches_numpy(mode, grads):
    """Any shapes, dtypes and values, eager and compiled: numpy's answer.

    Sums of the largest finite values overflow; the answer must not change.
    """
    expected = all(np.all(np.isfinite(g)) for g in grads)
    check = compiled(lambda gs: backends.current.all_finite(gs), mode)
    tensors = [ops.convert_to_tensor(g) for g in grads]
    assert bool(numpy(check(tensors))) is expected


def test_unscaling_is_float32_for_float16_gradients():
    """A scale above float16's max (65504) must not become inf in the division."""
    variable = keras.Variable(np.zeros(2, np.float16), dtype="float16")
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=2.0**20, max_scale=2.0**24
    )
    # The true gradient 2**-10 scaled by 2**20 is 1024, representable in float16.
    optimizer.apply([tensor([1024.0, 2048.0], "float16")], [variable])
    np.testing.assert_array_equal(numpy(variable), np.array([-(2.0**-10), -(2.0**-9)], np.float16))
