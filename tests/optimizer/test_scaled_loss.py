"""`scale_loss` (`scaled_loss.py`, issue 75.1): a step whose loss is not
finite is skipped and counted, as one whose gradients are not, in `fit`
and in a custom loop, in float16 and in bfloat16 (a scale of 1).

A head in half that overflows predicts inf: its MAE is inf, and MAE's
gradient (the sign of the error) is finite, so the step was applied before.
"""

import keras
import numpy as np
import pytest

import keras_mp
from tests.steps import BACKEND
from tests.steps import numpy

L = keras.layers
# A kernel whose outputs overflow each half on inputs of 1 (8 of them),
# while its gradient (the inputs times the MAE's) stays finite.
LARGE = {"float16": 1e4, "bfloat16": 1e38}


def _model(dtype):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            L.Dense(1, kernel_initializer=keras.initializers.Constant(LARGE[dtype]), name="price"),
        ]
    )
    # `amp_allow` keeps the head in half, where its outputs overflow.
    model.compile(optimizer="sgd", loss="mae", amp_level="O2", amp_dtype=dtype, amp_allow=["price"])
    return model


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fit_skips_and_counts_a_step_whose_loss_is_not_finite(dtype):
    model = _model(dtype)
    y = np.full((4, 1), 3.0, "float32")
    # A finite step: applied, its loss reported unscaled (MAE of 0 vs 3).
    logs = model.train_on_batch(np.zeros((4, 8), "float32"), y, return_dict=True)
    assert logs["loss"] == pytest.approx(3.0) and logs["skipped_steps"] == 0
    weights = [w.copy() for w in model.get_weights()]
    logs = model.train_on_batch(np.ones((4, 8), "float32"), y, return_dict=True)
    assert np.isinf(logs["loss"]) and logs["skipped_steps"] == 1
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def _gradients(model, optimizer, x, y):
    """The gradients of `scale_loss` of the MAE, taken as a custom loop
    takes them on this backend."""

    def loss_of(pred):
        return keras.ops.mean(keras.ops.abs(pred - keras.ops.convert_to_tensor(y)))

    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(loss_of(model(x)))
        return tape.gradient(scaled, model.trainable_variables)
    if BACKEND == "jax":
        import jax

        def scaled(trainable):
            return optimizer.scale_loss(loss_of(model.stateless_call(trainable, [], x)[0]))

        return jax.grad(scaled)([v.value for v in model.trainable_variables])
    model.zero_grad()
    optimizer.scale_loss(loss_of(model(x))).backward()
    return [v.value.grad for v in model.trainable_variables]


@pytest.mark.parametrize("initial_scale", [2.0**12, 1.0])
def test_a_custom_loop_skips_a_step_whose_loss_is_not_finite(initial_scale):
    """`scale_loss`, then `apply`: targets of inf give an inf MAE with a
    finite gradient. A fixed scale that checks no step applies it."""
    model = keras.Sequential([keras.Input((3,)), L.Dense(1)])
    x = np.ones((2, 3), "float32")
    y = np.full((2, 1), np.inf, "float32")
    dynamic = initial_scale != 1.0  # bfloat16's fixed scale of 1
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=dynamic, initial_scale=initial_scale
    )
    weights = [w.copy() for w in model.get_weights()]
    optimizer.apply(_gradients(model, optimizer, x, y), model.trainable_variables)
    assert int(numpy(optimizer.skipped_steps)) == 1
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    # Without the check (`skip_on_overflow=False`) the step is applied as given.
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=1.0, skip_on_overflow=False
    )
    optimizer.apply(_gradients(model, optimizer, x, y), model.trainable_variables)
    assert np.all(np.isfinite(model.get_weights()[0]))
    assert not np.array_equal(model.get_weights()[0], weights[0])
