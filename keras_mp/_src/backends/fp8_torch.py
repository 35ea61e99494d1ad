"""PyTorch: an FP8 layer's matmul as `torch._scaled_mm` GEMMs.

Forward, E4M3 inputs times E4M3 kernel; backward, a
`torch.autograd.Function` whose two GEMMs take the output gradient in E5M2
(torchao's `Float8Linear` with tensorwise scaling). `_scaled_mm` takes 2-D
operands, the second column-major, dimensions multiples of 16 and float32
scales: the einsum is laid out as one (M, K) x (K, N) GEMM. On a GPU
each dimension is padded with zeros to a multiple of 16 (M, the batch's
rows, which the rules cannot check, is the contracted one of the
kernel's gradient); PyTorch's CPU kernel takes any (the same numbers:
zeros add nothing). The same op runs on a CPU (in software) and on a GPU
with FP8 units (cuBLASLt).
"""

import math

from keras_mp._src.backends import fp8_common
from keras_mp._src.backends.fp8_common import E4M3
from keras_mp._src.backends.fp8_common import E5M2

MULTIPLE = 16


def _layout(form, x_shape, k_shape):
    """Permutations and sizes that lay the einsum out as (M, K) x (K, N)."""
    xs, ks, out = form
    x_free = [a for a in xs if a not in ks]
    contracted = [a for a in xs if a in ks]
    k_free = [a for a in ks if a not in xs]
    size = dict(zip(xs, x_shape))
    size.update(zip(ks, k_shape))
    return {
        "x": [xs.index(a) for a in x_free + contracted],
        "kernel": [ks.index(a) for a in contracted + k_free],
        # from (x_free, k_free) to the output's order, and back.
        "out": [(x_free + k_free).index(a) for a in out],
        "grad": [out.index(a) for a in x_free + k_free],
        "m": math.prod(size[a] for a in x_free),
        "k": math.prod(size[a] for a in contracted),
        "n": math.prod(size[a] for a in k_free),
        "x_sizes": [size[a] for a in x_free + contracted],
        "k_sizes": [size[a] for a in contracted + k_free],
        "out_sizes": [size[a] for a in x_free + k_free],
    }


def _inverse(permutation):
    return [permutation.index(i) for i in range(len(permutation))]


def _padded(a, rows, columns):
    """`a` with zero rows and columns up to `rows` x `columns`."""
    import torch

    if tuple(a.shape) == (rows, columns):
        return a
    out = torch.zeros((rows, columns), dtype=a.dtype, device=a.device)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _up(n):
    return -(-n // MULTIPLE) * MULTIPLE


def scaled_mm(a, b, a_scale, b_scale, compute_dtype, out_dtype, fast=False):
    """`a @ b` of FP8 `a` (M, K) and `b` (K, N), dequantized by their
    scales, in `out_dtype`: `torch._scaled_mm` on `a` row-major and `b`
    column-major, each dimension padded to a multiple of 16 on a GPU."""
    import torch

    if not has_fp8_gemm(a.device):
        return dequantized_mm(a, b, a_scale, b_scale, compute_dtype, out_dtype)
    m, k = a.shape
    n = b.shape[1]
    if a.is_cuda:
        a, b = _padded(a, _up(m), _up(k)), _padded(b.t(), _up(n), _up(k)).t()
    a, b = a.contiguous(), b.t().contiguous().t()
    out = torch._scaled_mm(
        a,
        b,
        fp8_common.dequantizing(a_scale, compute_dtype),
        fp8_common.dequantizing(b_scale, compute_dtype),
        out_dtype=out_dtype,
        use_fast_accum=fast,
    )
    return out[:m, :n]


def has_fp8_gemm(device):
    """Whether `torch._scaled_mm` runs on `device`: a CPU (its kernel, in
    software), a CUDA GPU of compute capability 8.9 (Ada) or more."""
    import torch

    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def dequantized_mm(a, b, a_scale, b_scale, compute_dtype, out_dtype):
    """`scaled_mm`'s product where no FP8 GEMM runs (a GPU before Ada): the
    FP8 operands dequantized and multiplied in the compute dtype."""
    import torch

    dtype = getattr(torch, compute_dtype)
    dequantized = [
        t.to(dtype) * fp8_common.dequantizing(s, compute_dtype).to(dtype)
        for t, s in ((a, a_scale), (b, b_scale))
    ]
    return (dequantized[0] @ dequantized[1]).to(out_dtype)


def gemm(form, x, kernel, state, training, compute_dtype):
    """`fp8_jax.gemm`'s contract, through `torch._scaled_mm`."""
    return _function()(form, training, compute_dtype, x, kernel, *state)


_FUNCTION = []


def _function():
    """The `torch.autograd.Function`, made once (torch imported lazily)."""
    if _FUNCTION:
        return _FUNCTION[0].apply
    import torch

    class Fp8Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, form, training, compute_dtype, x, kernel, *state):
            x_scale, x_history, k_scale, k_history, _, _ = state
            layout = _layout(form, x.shape, kernel.shape)
            x8 = fp8_common.quantize(x, x_scale, E4M3, compute_dtype)
            k8 = fp8_common.quantize(kernel, k_scale, E4M3, compute_dtype)
            x2 = x8.permute(layout["x"]).reshape(layout["m"], layout["k"])
            k2 = kernel_2d = k8.permute(layout["kernel"]).reshape(layout["k"], layout["n"])
            # torchao's forward GEMM accumulates fast (a GPU's FP8 sum in
            # fewer bits), its two backward GEMMs do not.
            y = scaled_mm(x2, k2, x_scale, k_scale, compute_dtype, x.dtype, fast=True)
            y = y.reshape(layout["out_sizes"]).permute(layout["out"])
            if training:
                updated = fp8_common.forward_updates(x, kernel, state)
            else:
                updated = tuple(t.detach().clone() for t in state[:4])
            ctx.layout, ctx.compute_dtype = layout, compute_dtype
            ctx.dtypes = (x.dtype, kernel.dtype)
            ctx.save_for_backward(x2, kernel_2d, x_scale, k_scale, *state[4:], *updated)
            return y

        @staticmethod
        def backward(ctx, g):
            x2, k2, x_scale, k_scale, g_scale, g_history, *updated = ctx.saved_tensors
            layout, compute_dtype = ctx.layout, ctx.compute_dtype
            x_dtype, k_dtype = ctx.dtypes
            g8 = fp8_common.quantize(g, g_scale, E5M2, compute_dtype)
            g2 = g8.permute(layout["grad"]).reshape(layout["m"], layout["n"])
            dx = dk = None
            # A GEMM whose gradient nothing takes is not run (the model's
            # inputs; a frozen kernel), as JAX drops it from its program.
            if ctx.needs_input_grad[3]:
                dx = scaled_mm(g2, k2.t(), g_scale, k_scale, compute_dtype, x_dtype)
                dx = dx.reshape(layout["x_sizes"]).permute(_inverse(layout["x"]))
            if ctx.needs_input_grad[4]:
                dk = scaled_mm(x2.t(), g2, x_scale, g_scale, compute_dtype, k_dtype)
                dk = dk.reshape(layout["k_sizes"]).permute(_inverse(layout["kernel"]))
            g_updated = (
                fp8_common.new_scale(g_history, g_scale, E5M2),
                fp8_common.new_history(g, g_history),
            )
            return (None, None, None, dx, dk, *updated, *g_updated)

    _FUNCTION.append(Fp8Matmul)
    return Fp8Matmul.apply


def train_step_gemms(model, data):
    """The `torch._scaled_mm` calls of one train step (`train_on_batch`,
    every variable put back after it), as PyTorch dispatches them."""
    from keras_mp._src.backends import torch_dispatch

    found = []
    torch_dispatch.matmuls_of_one_step(model, data, fp8_operands=found)
    return found
