"""JAX: an FP8 layer's matmul as `lax.dot_general` on FP8 operands.

Forward, E4M3 inputs times E4M3 kernel into a float32 sum; backward, a
custom VJP whose two GEMMs take the output gradient in E5M2 (Flax's
`fp8_ops.quantized_dot`, MaxText's and Praxis's form). The dot's operands
are FP8 in the program JAX lowers, so XLA has nothing to match or strip:
on a GPU with FP8 units its GEMM rewriter calls cuBLASLt's FP8 matmul,
the scales fused (`xla/service/gpu/transforms/gemm_rewriter.cc`); XLA's
CPU computes the same dot in software, the same numbers.
"""

import re

from keras_mp._src.backends import fp8_common
from keras_mp._src.backends.fp8_common import E4M3
from keras_mp._src.backends.fp8_common import E5M2


def _dot(subscripts, a, b, a_scale, b_scale, compute_dtype, dtype):
    import jax.numpy as jnp

    product = jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)
    scale = fp8_common.dequantizing(a_scale, compute_dtype)
    scale = scale * fp8_common.dequantizing(b_scale, compute_dtype)
    return (product * scale).astype(dtype)


def gemm(form, x, kernel, state, training, compute_dtype):
    """The layer's matmul `form` (`fp8_common.gemm_form`) of `x` and
    `kernel` in FP8, in `compute_dtype`; `state`: the layer's six scale and
    history tensors (`fp8_common.STATE`), whose gradients are their next
    values (in training; the same values otherwise, and always for the
    output gradient's, as Keras's float8 layers)."""
    import jax

    xs, ks, out = form
    x_dtype, kernel_dtype = x.dtype, kernel.dtype

    def forward(x, kernel, state):
        x_scale, x_history, k_scale, k_history, _, _ = state
        x8 = fp8_common.quantize(x, x_scale, E4M3, compute_dtype)
        k8 = fp8_common.quantize(kernel, k_scale, E4M3, compute_dtype)
        y = _dot(f"{xs},{ks}->{out}", x8, k8, x_scale, k_scale, compute_dtype, compute_dtype)
        if training:
            updated = fp8_common.forward_updates(x, kernel, state)
        else:
            updated = tuple(state[:4])
        return y, (x8, k8, updated, state[0], state[2], state[4], state[5])

    def backward(saved, g):
        x8, k8, updated, x_scale, k_scale, g_scale, g_history = saved
        g8 = fp8_common.quantize(g, g_scale, E5M2, compute_dtype)
        dx = _dot(f"{out},{ks}->{xs}", g8, k8, g_scale, k_scale, compute_dtype, x_dtype)
        dk = _dot(f"{xs},{out}->{ks}", x8, g8, x_scale, g_scale, compute_dtype, kernel_dtype)
        g_updated = (
            fp8_common.new_scale(g_history, g_scale, E5M2),
            fp8_common.new_history(g, g_history),
        )
        return dx, dk, tuple(updated) + g_updated

    @jax.custom_vjp
    def fp8_matmul(x, kernel, state):
        return forward(x, kernel, state)[0]

    fp8_matmul.defvjp(forward, backward)
    return fp8_matmul(x, kernel, tuple(state))


# `stablehlo.dot_general %a, %b, ... : (tensor<4x8xf8E4M3FN>, tensor<...>) -> ...`
_DOT = re.compile(r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)")
_DTYPES = {"f8E4M3FN": E4M3, "f8E5M2": E5M2}


def fp8_dots(text):
    """`[(dtype, dtype)]` of each dot of two FP8 operands in StableHLO
    `text` (the operands' dtypes in name order)."""
    found = []
    for a, b in _DOT.findall(text):
        dtypes = tuple(_DTYPES.get(t.split("x")[-1]) for t in (a, b))
        if None not in dtypes:
            found.append(tuple(sorted(dtypes)))
    return found


def train_step_gemms(model, data):
    """The FP8 dots of the StableHLO JAX lowers `fit`'s train step to,
    before any of XLA's passes (nothing compiled, nothing run)."""
    import jax

    from keras_mp._src import keras_internals

    keras_internals.build_for_training(model, data)
    state = keras_internals.jax_training_state(model)
    return fp8_dots(jax.jit(model.train_step).lower(state, data).as_text())
