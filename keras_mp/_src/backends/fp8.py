"""FP8 GEMMs, behind the switch on the backend.

`current` is the module that multiplies an FP8 layer's operands in FP8 on
this process's backend (`fp8_jax`: `lax.dot_general` on FP8 operands;
`fp8_torch`: `torch._scaled_mm`), or None where the backend has none that
runs in its step (TensorFlow: Keras's float8 layers then quantize and
dequantize, and the matmul is bfloat16's). Each module has `gemm` (the
layer's matmul) and `train_step_gemms` (the FP8 dots of its train step's
program, for the compiled census).
"""

import importlib

import keras

_MODULES = {"jax": "fp8_jax", "torch": "fp8_torch"}

_name = _MODULES.get(keras.backend.backend())
current = importlib.import_module(f"keras_mp._src.backends.{_name}") if _name else None


def matmul_words():
    """What an FP8 layer's matmul is on this backend, for its rule's reason."""
    if current is not None:
        return "matmul in FP8 (E4M3 forward, E5M2 gradients)"
    return (
        "matmul in FP8 precision (E4M3 forward, E5M2 gradients), quantized and "
        "dequantized, multiplied in bfloat16"
    )


def train_step_gemms(model, data):
    """`[(dtype, dtype)]`: the FP8 dtypes of both operands of each matmul
    of `model`'s train step on `data` whose operands are both FP8 (none
    where the backend multiplies no FP8 operands)."""
    if current is not None:
        return current.train_step_gemms(model, data)
    if keras.backend.backend() == "tensorflow":
        from keras_mp._src.backends import tensorflow
        from keras_mp._src.backends import tf_graph

        return tf_graph.fp8_dots(tensorflow.train_step_graph(model, data))
    return []
