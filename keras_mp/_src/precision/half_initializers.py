"""Initializers that cannot compute in half precision compute in float32.

Keras's `Orthogonal` (the recurrent kernels of LSTM, GRU and SimpleRNN)
takes a QR decomposition in the variable's dtype, which TensorFlow (`Qr`)
and PyTorch (`geqrf`) have no bfloat16 or float16 kernel for: a model whose
recurrent weights are half (O3, or built under Keras's `bfloat16` policy)
could be trained but not built again, so `load_model` failed on it. Here
such an initializer computes in float32 and its result is cast to the
variable's dtype: on every backend, the float32 matrix rounded once (JAX,
whose QR takes bfloat16, got a matrix orthogonal only to bfloat16's
precision). Installed by `compile.install`.
"""

import functools

import keras

HALF = ("float16", "bfloat16")
# The initializers whose arithmetic has no half kernels on some backend.
IN_FLOAT32 = (keras.initializers.Orthogonal,)


def _in_float32(call):
    @functools.wraps(call)
    def call_in_float32(self, shape, dtype=None, **kwargs):
        dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())
        if dtype not in HALF:
            return call(self, shape, dtype=dtype, **kwargs)
        return keras.ops.cast(call(self, shape, dtype="float32", **kwargs), dtype)

    call_in_float32._keras_mp_in_float32 = True
    return call_in_float32


def install():
    """Wraps each initializer of `IN_FLOAT32` (idempotent)."""
    for cls in IN_FLOAT32:
        call = cls.__call__
        if not getattr(call, "_keras_mp_in_float32", False):
            cls.__call__ = _in_float32(call)
