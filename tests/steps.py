"""What the tests of the optimizer's step share: tensors in and out, a
snapshot of everything a skipped step must leave as it was, and markers."""

import keras
import numpy as np
import pytest

from keras_mp._src import backends

BACKEND = keras.backend.backend()

# For tests that hand the optimizer gradients they scaled themselves, which
# the optimizer's warning of a loss never scaled tells to ignore.
SCALED_BY_HAND = pytest.mark.filterwarnings(
    r"ignore:LossScaleOptimizer\.\w+ was called, but the loss was never scaled"
)

# TensorFlow's XLA step as compiled for a CPU: on a GPU the skip is selects
# (`keep_conditional`) and the tensors live in the GPU's memory.
tensorflow_xla_on_cpu = pytest.mark.skipif(
    BACKEND != "tensorflow" or bool(backends.current.gpu_compute_capability()),
    reason="TensorFlow's XLA step on a CPU",
)


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def tensor(values, dtype="float32"):
    return keras.ops.convert_to_tensor(np.asarray(values, dtype=dtype))


def snapshot(optimizer, variables):
    """Every variable's value and the optimizer's, copied."""
    return [numpy(v).copy() for v in list(variables) + list(optimizer.variables)]


def compiled(fn, mode):
    """`fn` as `fit` runs it: eager, or traced by the backend's compiler."""
    if mode == "eager":
        return fn
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=(mode == "xla"))


COMPILE_MODES = {
    "tensorflow": ["eager", "graph", "xla"],
    "jax": ["eager", "jit"],
    "torch": ["eager"],
}[BACKEND]
