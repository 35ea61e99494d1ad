"""What every backend's FP8 GEMM shares: a layer's einsum as a GEMM, and
Keras's own recipe (its quantization, its scale and amax-history updates).

An FP8 layer's matmul computes on FP8 operands (E4M3 inputs and kernel
forward; the output gradient in E5M2 in both backward GEMMs), each operand
quantized exactly as Keras's `quantize_and_dequantize` quantizes it (so the
FP8 values are Keras's), and the FP8 product scaled back by the two scales
in float32 after the sum, as Flax's `fp8_ops` and Transformer Engine do.
The scales and amax histories are Keras's variables, their new values
handed out as their gradients (`overwrite_with_gradient`) by Keras's own
update rule: delayed scaling, the scale of this step from the history
before it.
"""

import string

import keras
import ml_dtypes

E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
# The order of an FP8 layer's state, as the GEMMs take it.
STATE = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


def gemm_form(equation, x_ndim):
    """`(x, kernel, output)` subscripts of a layer's matmul as an einsum
    with no ellipsis, in which every axis is either contracted (in the
    inputs and the kernel) or kept from one of them (in the output): one
    GEMM, whose two gradients are the einsums `output,kernel->x` and
    `x,output->kernel`. `equation` None: a Dense's matmul over the last
    axis. None where the einsum is not one GEMM (an axis summed away, a
    batch axis on both operands, a repeated axis): Keras's own call then."""
    if equation is None:
        batch = string.ascii_lowercase[: x_ndim - 1]
        return f"{batch}y", "yz", f"{batch}z"
    try:
        operands, out = equation.replace(" ", "").split("->")
        x, kernel = operands.split(",")
    except ValueError:
        return None
    if "..." in x:
        free = [c for c in string.ascii_letters if c not in equation]
        count = x_ndim - (len(x) - 3)
        if count < 0 or "..." not in out:
            return None
        x = x.replace("...", "".join(free[:count]))
        out = out.replace("...", "".join(free[:count]))
    if "..." in kernel or "..." in out or len(x) != x_ndim:
        return None
    if any(len(set(s)) != len(s) for s in (x, kernel, out)):
        return None
    if any((a in x) + (a in kernel) + (a in out) != 2 for a in set(x + kernel + out)):
        return None
    if not any(a in kernel for a in x):
        return None
    return x, kernel, out


def quantize(x, scale, dtype, compute_dtype):
    """`x` in FP8 `dtype`: Keras's `quantize_and_dequantize` up to its
    cast to FP8 (the same values)."""
    top = keras.ops.cast(float(ml_dtypes.finfo(dtype).max), compute_dtype)
    x = keras.ops.divide(x, keras.ops.cast(scale, compute_dtype))
    return keras.ops.cast(keras.ops.clip(x, -top, top), dtype)


def dequantizing(scale, compute_dtype):
    """The float32 factor that dequantizes a value quantized by `scale`:
    the scale as `quantize` divided by it (rounded to the compute dtype)."""
    return keras.ops.cast(keras.ops.cast(scale, compute_dtype), "float32")


def new_scale(history, scale, dtype):
    """Keras's next scale: from the maximum of the amax history so far."""
    top = keras.ops.cast(float(ml_dtypes.finfo(dtype).max), "float32")
    return keras.quantizers.compute_float8_scale(keras.ops.max(history, axis=0), scale, top)


def new_history(x, history):
    """Keras's next amax history: this step's amax of `x` first."""
    return keras.quantizers.compute_float8_amax_history(x, history)


def forward_updates(x, kernel, state):
    """A training forward pass's new input and kernel scales and amax
    histories (`state`'s first four, in `STATE`'s order)."""
    x_scale, x_history, k_scale, k_history = state[:4]
    return (
        new_scale(x_history, x_scale, E4M3),
        new_history(x, x_history),
        new_scale(k_history, k_scale, E4M3),
        new_history(kernel, k_history),
    )
