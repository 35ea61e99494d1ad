"""Gradient clipping over float32 and half gradients at once.

Keras's optimizers clip as if every gradient had one dtype: `global_clipnorm`
stacks the per-variable squared norms and multiplies each gradient by one
float32 scale, which TensorFlow refuses when O3 leaves some variables float32
(BatchNorm with `keep_batchnorm_fp32`, the output layer) beside half ones.
A squared norm summed in float16 also overflows once the norm passes 256.
keras_mp has the optimizer clip float32 copies of half gradients and cast
the results back, the way Apex computes its norms in float32: the clipped
gradients and everything after them (accumulators, update step) keep their
dtypes.
"""

import keras

_MARK = "_keras_mp_clips_in_float32"


def clip_in_float32(optimizer):
    """Makes `optimizer` clip half gradients in float32 (idempotent)."""
    if getattr(optimizer, _MARK, False) or not hasattr(optimizer, "_clip_gradients"):
        return optimizer
    keras_clip = optimizer._clip_gradients  # the bound method of its class

    def clip_gradients(grads):
        clips = optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue
        dtypes = [None if g is None else keras.backend.standardize_dtype(g.dtype) for g in grads]
        if not clips or all(d in (None, "float32", "float64") for d in dtypes):
            return keras_clip(grads)  # no casts where nothing is clipped
        up = [g if d in (None, "float32", "float64") else keras.ops.cast(g, "float32")
              for g, d in zip(grads, dtypes)]
        clipped = keras_clip(up)
        return [c if d in (None, "float32", "float64") else keras.ops.cast(c, d)
                for c, d in zip(clipped, dtypes)]

    optimizer._clip_gradients = clip_gradients
    setattr(optimizer, _MARK, True)
    return optimizer
