"""The ops `cpu_rates.py` times, each run on the CPU as `fit` runs a step's
ops with this process's backend: JAX jit-compiled, TensorFlow in a graph
without XLA (Keras turns XLA off on a machine without a GPU), PyTorch
eager; Keras's own ops elsewhere. `matmul(n, dtype)` and
`elementwise(n, dtype)` return a callable that runs one and returns once
its result is ready."""

import keras
import numpy as np

from keras_mp._src.backends.common import NAME


def matmul(n, dtype):
    """One `n` x `n` x `n` matmul in `dtype`."""
    rng = np.random.default_rng(0)
    return _program(lambda a, b: a @ b, [rng.random((n, n)) for _ in range(2)], dtype)


def elementwise(n, dtype):
    """One elementwise op (`x * x`) on `n` values in `dtype`."""
    return _program(lambda x: x * x, [np.random.default_rng(0).random(n)], dtype)


def _program(function, arrays, dtype):
    return _PROGRAMS.get(NAME, _keras)(function, [a.astype("float32") for a in arrays], dtype)


def _jax(function, arrays, dtype):
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    values = [jax.device_put(jnp.asarray(a, dtype), cpu) for a in arrays]
    compiled = jax.jit(function)
    return lambda: compiled(*values).block_until_ready()


def _tensorflow(function, arrays, dtype):
    import tensorflow as tf

    with tf.device("/CPU:0"):
        values = [tf.cast(tf.constant(a), dtype) for a in arrays]
    graph = tf.function(function, jit_compile=False)

    def run():
        # Eager execution returns once the graph has run.
        with tf.device("/CPU:0"):
            return graph(*values)

    return run


def _torch(function, arrays, dtype):
    import torch

    values = [torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays]
    return lambda: function(*values)


def _keras(function, arrays, dtype):
    values = [keras.ops.cast(keras.ops.convert_to_tensor(a), dtype) for a in arrays]
    return lambda: keras.ops.convert_to_numpy(function(*values))


_PROGRAMS = {"jax": _jax, "tensorflow": _tensorflow, "torch": _torch}
