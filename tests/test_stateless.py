"""`stateless_apply`: the step as a function of values (JAX)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp._src import backends
from tests.loops import check_loop_result
from tests.loops import loop_data
from tests.loops import loop_model

BACKEND = keras.backend.backend()

# These tests hand the optimizer gradients they scaled themselves, which
# the optimizer's warning of a loss never scaled tells to ignore.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:LossScaleOptimizer\.\w+ was called, but the loss was never scaled"
)

# TensorFlow's XLA step as compiled for a CPU: on a GPU the skip is selects
# (`keep_conditional`) and the tensors live in the GPU's memory.
tensorflow_xla_on_cpu = pytest.mark.skipif(
    BACKEND != "tensorflow" or bool(backends.current.gpu_compute_capability()),
    reason="TensorFlow's XLA step on a CPU",
)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _tensor(values, dtype="float32"):
    return ops.convert_to_tensor(np.asarray(values, dtype=dtype))


def _snapshot(optimizer, variables):
    return [_numpy(v).copy() for v in list(variables) + list(optimizer.variables)]


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
