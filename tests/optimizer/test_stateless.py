"""`stateless_apply`: the step as a function of values (JAX)."""

import keras
import pytest

import keras_mp
from tests.loops import check_loop_result
from tests.loops import loop_data
from tests.loops import loop_model
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND

pytestmark = SCALED_BY_HAND


@pytest.mark.skipif(BACKEND != "jax", reason="jax.grad loop")
@pytest.mark.parametrize("jit", [False, True])
def test_custom_loop_jax_stateless(jit):
    import jax

    x, y = loop_data()
    model = loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
    optimizer.build(model.trainable_variables)

    def loss_fn(trainable, optimizer_values, x, y):
        pred, _ = model.stateless_call(trainable, [], x)
        loss = jax.numpy.mean(jax.numpy.square(pred - y))
        scale = optimizer_values[
            [id(v) for v in optimizer.variables].index(id(optimizer.loss_scale))
        ]
        return loss * scale

    def train_step(trainable, optimizer_values, x, y):
        grads = jax.grad(loss_fn)(trainable, optimizer_values, x, y)
        return optimizer.stateless_apply(optimizer_values, grads, trainable)

    step = jax.jit(train_step) if jit else train_step
    trainable, optimizer_values = step(
        [v.value for v in model.trainable_variables], [v.value for v in optimizer.variables], x, y
    )
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    check_loop_result(model, x, y)
