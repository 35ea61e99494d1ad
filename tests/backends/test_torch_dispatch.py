"""Matmuls PyTorch dispatches in one step (`backends/torch_dispatch.py`):
counted by hand, and the model, its optimizer and metrics as before."""

import keras
import numpy as np
import pytest

from tests.steps import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's dispatcher")


@pytest.mark.perf
def test_one_step_s_matmuls_and_nothing_changed():
    from keras_mp._src.backends import torch_dispatch

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(),
         keras.layers.Dense(5)]
    )  # fmt: skip
    model.compile(optimizer="adam", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    x, y = np.ones((2, 8, 8, 3), "float32"), np.ones((2, 5), "float32")
    model.fit(x, y, verbose=0)  # slots and iterations that are not zeros
    state = model.variables + model.optimizer.variables + model.metrics_variables
    before = [keras.ops.convert_to_numpy(v) for v in state]
    found = torch_dispatch.matmuls_of_one_step(model, (x, y))
    conv = 2 * (2 * 6 * 6 * 4) * (3 * 3 * 3)
    dense = 2 * 2 * 5 * (6 * 6 * 4)
    flops = sorted((kind, dtype, n) for kind, dtype, n in found)
    # Forward; backward: the Dense's two gradients, the Conv2D's kernel
    # gradient (its input's is not needed).
    assert flops == sorted(
        [("convolution", "bfloat16", conv), ("convolution", "bfloat16", conv)]
        + [("dot", "bfloat16", dense)] * 3
    ), flops
    for variable, value in zip(state, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
