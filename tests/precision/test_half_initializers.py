"""Initializers without half kernels compute in float32 (`half_initializers.py`):
a model with half recurrent weights builds, and so loads, on every backend."""

import keras
import numpy as np
import pytest

import keras_mp  # noqa: F401  (`import keras_mp` installs them)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_orthogonal_in_half_is_the_float32_matrix_rounded(dtype):
    initializer = keras.initializers.Orthogonal(seed=3)
    half = initializer((8, 8), dtype=dtype)  # TensorFlow's and PyTorch's QR refused
    assert keras.backend.standardize_dtype(half.dtype) == dtype
    full = keras.initializers.Orthogonal(seed=3)((8, 8), dtype="float32")
    expected = keras.ops.convert_to_numpy(keras.ops.cast(full, dtype)).astype("float32")
    got = keras.ops.convert_to_numpy(keras.ops.cast(half, "float32"))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got.T @ got, np.eye(8), atol=0.05)


def test_an_lstm_in_bfloat16_builds():
    layer = keras.layers.LSTM(4, dtype="bfloat16")
    out = layer(np.ones((2, 3, 5), "float32"))
    assert layer.cell.recurrent_kernel.dtype == "bfloat16"
    assert np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))).all()
