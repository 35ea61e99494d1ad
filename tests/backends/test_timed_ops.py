"""`timed_ops`: the ops `cpu_rates` times compute what they say, in the
dtype asked for, with this process's backend (each backend its own way)."""

import keras
import numpy as np
import pytest

from keras_mp._src.backends import timed_ops


def _numpy(value):
    """A backend's tensor as float32 values, and its dtype's name."""
    dtype = keras.backend.standardize_dtype(value.dtype)
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(value, "float32"))), dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_op_runs_in_its_dtype_and_gives_its_result(dtype):
    rng = np.random.default_rng(0)
    a, b = rng.random((4, 4)), rng.random((4, 4))
    product, computed = _numpy(timed_ops.matmul(4, dtype)())
    assert computed == dtype
    np.testing.assert_allclose(product, a @ b, rtol=2e-2 if dtype == "bfloat16" else 1e-5)
    square, computed = _numpy(timed_ops.elementwise(8, dtype)())
    assert computed == dtype and square.shape == (8,)
