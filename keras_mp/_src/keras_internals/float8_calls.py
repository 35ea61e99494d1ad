"""Keras's float8 Dense and EinsumDense from inside: their own float8 call
(`_float8_call`, which `quantized_call` runs), replaced on one layer by a
call whose matmul is an FP8 GEMM (`backends.fp8`), their kernel (`_kernel`).
"""

import keras


def keras_float8_call(layer):
    """The layer's class's own float8 call (quantize-dequantize), bound."""
    return type(layer)._float8_call.__get__(layer)


def replaced_call(layer):
    """The float8 call set on this layer (`set_float8_call`), or None."""
    return layer.__dict__.get("_float8_call")


def set_float8_call(layer, gemm=None, before=None, **marks):
    """Sets `layer`'s float8 call: `before(inputs, training)` first, where
    given, then its matmul as `gemm(form, inputs, kernel, state, training,
    compute_dtype)` (`fp8_jax.gemm`'s contract) where given and the
    layer's einsum is one GEMM (`fp8_common.gemm_form`), Keras's own call
    otherwise. Neither given: the class's own call again. `marks` are set
    on the call (what it does, for the rules)."""
    if gemm is None and before is None:
        layer.__dict__.pop("_float8_call", None)
        return
    from keras_mp._src.backends import fp8_common

    keras_call = keras_float8_call(layer)
    equation = layer.equation if isinstance(layer, keras.layers.EinsumDense) else None

    def float8_call(inputs, training=None):
        if before is not None:
            before(inputs, training)
        inputs = keras.ops.convert_to_tensor(inputs)
        form = fp8_common.gemm_form(equation, len(inputs.shape)) if gemm else None
        if form is None:
            return keras_call(inputs, training=training)
        if layer.lora_enabled:
            raise NotImplementedError("Currently, `_float8_call` doesn't support LoRA")
        state = [keras.ops.convert_to_tensor(getattr(layer, n)) for n in fp8_common.STATE]
        kernel = keras.ops.convert_to_tensor(layer._kernel)
        x = gemm(form, inputs, kernel, state, training, layer.compute_dtype)
        if layer.bias is not None:
            bias = layer.bias
            # As Keras's float8 call: a float32 bias rounded through bfloat16.
            if layer.dtype_policy.compute_dtype == "float32":
                bias = keras.ops.cast(keras.ops.cast(bias, "bfloat16"), bias.dtype)
            x = keras.ops.add(x, bias)
        if layer.activation is not None:
            x = layer.activation(x)
        return x

    for name, value in marks.items():
        setattr(float8_call, name, value)
    object.__setattr__(layer, "_float8_call", float8_call)
