"""An FP8 layer's matmul as FP8 GEMMs (`backends/fp8.py`: JAX's
`lax.dot_general` on FP8 operands, PyTorch's `torch._scaled_mm`) keeps
Keras's recipe: two training steps of one FP8 Dense from the same weights
on the same batch, beside Keras's own float8 Dense (quantize-dequantize
around a bfloat16 matmul), leave the same input scale and amax history bit
for bit (the FP8 values and the delayed update are Keras's), the kernel's
and the output gradient's within bfloat16's rounding of the trained kernel
and E4M3's of the outputs, and the same outputs within E4M3's rounding.
"""

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="TensorFlow's FP8 is Keras's own quantize-dequantize"
)
E4M3_ROUNDOFF = 2.0**-4


def _state(layer):
    names = ("inputs_scale", "inputs_amax_history", "kernel_scale", "kernel_amax_history")
    names += ("outputs_grad_scale", "outputs_grad_amax_history")
    return {n: np.array(keras.ops.convert_to_numpy(getattr(layer, n))) for n in names}


def test_fp8_gemms_keep_keras_scales_and_amax_histories():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 48)).astype("float32")
    y = rng.normal(size=(32, 32)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((48,)), L.Dense(32, name="fp8")])
    policy = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16")
    twin = keras.Sequential([keras.Input((48,)), L.Dense(32, dtype=policy)])
    twin.layers[0].kernel.assign(keras.ops.convert_to_numpy(model.layers[0].kernel))
    keras_mp.apply_amp(model, "O2", "float8", allow=["fp8"])
    assert model.layers[0].dtype_policy.name == "float8_from_mixed_bfloat16"
    # From the same state (keras_mp starts the kernel's scale from its amax).
    for name, value in _state(model.layers[0]).items():
        getattr(twin.layers[0], name).assign(value)
    for m in (model, twin):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for step in (1, 2):  # inputs that grow: a delayed scale lags them
            m.train_on_batch(step * x, y)
    ours, keras_own = _state(model.layers[0]), _state(twin.layers[0])
    for name in ("inputs_scale", "inputs_amax_history"):
        np.testing.assert_array_equal(ours[name], keras_own[name], err_msg=name)
    for name in ("kernel_scale", "kernel_amax_history"):
        np.testing.assert_allclose(ours[name], keras_own[name], rtol=2**-7, err_msg=name)
    for name in ("outputs_grad_scale", "outputs_grad_amax_history"):
        np.testing.assert_allclose(ours[name], keras_own[name], rtol=E4M3_ROUNDOFF, err_msg=name)
    got = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
    want = keras.ops.convert_to_numpy(keras.ops.cast(twin(x), "float32"))
    assert np.linalg.norm(got - want) <= E4M3_ROUNDOFF * np.linalg.norm(want)
