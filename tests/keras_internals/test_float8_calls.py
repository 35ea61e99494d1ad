"""An FP8 layer's own call (`float8_calls.set_float8_call`): an
EinsumDense whose equation is not one GEMM (an axis summed away) keeps
Keras's own float8 call, quantize-dequantize, and trains; the program has
no FP8 dot for it."""

import keras
import numpy as np
import pytest

from keras_mp._src.tools import compiled_census


@pytest.mark.one_backend
def test_an_einsum_that_is_not_one_gemm_keeps_keras_float8_call():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 32))
    x = keras.layers.Dense(32, name="first")(inputs)
    x = keras.layers.EinsumDense("abc,cd->ad", 16, name="summed")(x)
    model = keras.Model(inputs, keras.layers.Dense(16, name="head")(x))
    model.compile(
        optimizer="adam",
        loss="mse",
        amp_level="O2",
        amp_dtype="float8",
        float8_recipe={"small_gemm": None},
    )
    assert model.get_layer("summed").dtype_policy.quantization_mode == "float8"
    x = np.random.default_rng(0).normal(size=(16, 4, 32)).astype("float32")
    y = np.zeros((16, 16), "float32")
    assert compiled_census.fp8_gemms(model, x, y) == {}
    loss = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    assert np.isfinite(loss).all()
