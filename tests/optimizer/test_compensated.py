"""Compensated updates (`compensated.py`): bfloat16 variables stepped in
float32 with a bfloat16 buffer of what rounding lost, and no float32 copy."""

import keras
import numpy as np
import pytest

import keras_mp
from tests import models


def test_compensated_updates_keep_no_float32_copy():
    """Adam, O3 bfloat16: a half variable costs its buffer and two bfloat16
    slots (6 bytes a weight) instead of a float32 copy and float32 slots (12)."""

    def optimizer_bytes(master_weights):
        model = models.o3_classifier(keras.optimizers.Adam(1e-3), master_weights=master_weights)
        model.optimizer.build(model.trainable_variables)
        size = {"float32": 4, "float16": 2, "bfloat16": 2}
        arrays = [v for v in model.optimizer.variables if len(v.shape)]  # not the counters
        return sum(int(np.prod(v.shape)) * size[v.dtype] for v in arrays), model

    compensated, model = optimizer_bytes("compensated")
    masters, _ = optimizer_bytes(True)
    half = sum(int(np.prod(v.shape)) for v in models.half_weights(model))
    full = sum(int(np.prod(v.shape)) for v in model.trainable_variables) - half
    assert half > 0
    assert compensated == 6 * half + 8 * full
    assert masters == 12 * half + 8 * full


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_steps_below_bfloat16_spacing_add_up_in_the_buffer(inner):
    """A constant gradient whose SGD/Adam step is 1/8 of a weight's bfloat16
    spacing: a plain bfloat16 update rounds every step away, compensated
    updates move the weight by the steps' sum (within one spacing)."""
    weight = 1.0  # bfloat16 spacing at 1.0 is 2**-7
    step = 2.0**-10
    optimizer = {
        "sgd": lambda: keras.optimizers.SGD(step),
        "adam": lambda: keras.optimizers.Adam(step),
    }[inner]
    moved = {}
    for master_weights in (False, "compensated"):
        variable = keras.Variable(np.full((4,), weight, "float32"), dtype="bfloat16")
        lso = keras_mp.LossScaleOptimizer(
            optimizer(), dynamic=False, initial_scale=1.0, master_weights=master_weights
        )
        for _ in range(64):
            lso.apply([keras.ops.ones((4,), "bfloat16")], [variable])
        moved[master_weights] = weight - float(
            keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32"))[0]
        )
    assert moved[False] == 0.0  # every step rounded away
    assert moved["compensated"] == pytest.approx(64 * step, abs=2.0**-7)
