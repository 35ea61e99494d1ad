"""Compensated updates (`compensated.py`): bfloat16 variables stepped in
float32 with a bfloat16 buffer of what rounding lost, and no float32 copy."""

import keras
import numpy as np
import pytest

import keras_mp
from tests import models
from tests.steps import BACKEND


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


@pytest.mark.parametrize(
    "master_weights",
    [
        # PyTorch: torch.compile takes ~35 s on a CPU; its master copies
        # reconcile in bfloat16 there (no pair of casts to drop).
        pytest.param(True, marks=pytest.mark.skipif(BACKEND == "torch", reason="CI's time")),
        "compensated",
    ],
)
@pytest.mark.slow(reason="PyTorch: torch.compile's inductor compiles the step, 30-60 s on a CPU")
def test_a_compiled_fit_keeps_what_rounding_lost(master_weights):
    """`fit` compiled as Keras compiles it (XLA; PyTorch: `jit_compile=True`,
    torch.compile): steps of 1/8 of the bfloat16 spacing add up in the float32
    copy and in the compensation. A compiler may drop a pair of converts
    (torch.compile's inductor does on a CPU, XLA on a GPU), and the part of
    the step that rounding lost with them: `backends.current.rounded`."""
    x, y = np.ones((64, 1), "float32"), np.zeros((64, 1), "float32")
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="bfloat16")
    model = keras.Sequential([keras.Input((1,)), layer])
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0**-10), dynamic=False, initial_scale=1.0,
        master_weights=master_weights,
    )  # fmt: skip
    # The gradient of (w x)^2 / 2 is w, about 1: each step moves w by ~2**-10.
    loss = lambda t, p: 0.5 * keras.ops.mean(keras.ops.square(p - t))  # noqa: E731
    model.compile(optimizer, loss=loss, jit_compile=True)
    model.fit(x, y, batch_size=64, epochs=64, verbose=0)
    moved = 1.0 - float(keras.ops.convert_to_numpy(keras.ops.cast(layer.kernel, "float32"))[0, 0])
    assert moved == pytest.approx(1 - (1 - 2.0**-10) ** 64, abs=2.0**-7)
