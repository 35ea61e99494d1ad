"""PyTorch's FP8 GEMM (`fp8_torch.gemm`, an autograd Function around
`torch._scaled_mm`): the einsum and both its gradients within FP8's
rounding of float32's (E4M3 forward, the E5M2 output gradient backward),
on an equation that permutes its axes and rows (M = 6) that are no
multiple of 16, and the amax histories' new values handed out as their
gradients."""

import keras
import numpy as np
import pytest

from keras_mp._src.backends import fp8_common

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's own GEMM")


def _relative(got, want):
    return np.linalg.norm(got.detach().float().numpy() - want) / np.linalg.norm(want)


def test_the_gemm_and_its_gradients_follow_float32_within_fp8_rounding():
    import torch

    from keras_mp._src.backends import fp8_torch

    rng = np.random.default_rng(0)
    x, k, g = (
        rng.normal(size=s).astype("float32") for s in [(2, 3, 32), (32, 2, 16), (2, 3, 2, 16)]
    )
    form = fp8_common.gemm_form("btd,dnh->btnh", 3)
    state = [np.abs(x).max() / 448, np.zeros(4), np.abs(k).max() / 448, np.zeros(4)]
    state += [np.abs(g).max() / 57344, np.zeros(4)]
    state = [torch.tensor(s, dtype=torch.float32, requires_grad=True) for s in state]
    xt, kt = (torch.tensor(a, requires_grad=True) for a in (x, k))
    y = fp8_torch.gemm(form, xt, kt, state, True, "float32")
    y.backward(torch.tensor(g))
    assert _relative(y, np.einsum("btd,dnh->btnh", x, k)) < 2**-4
    assert _relative(xt.grad, np.einsum("btnh,dnh->btd", g, k)) < 2**-3
    assert _relative(kt.grad, np.einsum("btd,btnh->dnh", x, g)) < 2**-3
    got = [float(state[i].grad[0]) for i in (1, 3, 5)]
    np.testing.assert_allclose(got, [abs(a).max() for a in (x, k, g)], rtol=1e-6)


def test_where_no_fp8_gemm_runs_the_dequantized_product_is_the_same():
    """A GPU before Ada has no `_scaled_mm`: the FP8 operands are
    dequantized and multiplied in the compute dtype, the same product."""
    import torch

    from keras_mp._src.backends import fp8_torch

    rng = np.random.default_rng(0)
    a = torch.tensor(rng.normal(size=(32, 48)), dtype=torch.float32).to(torch.float8_e4m3fn)
    b = torch.tensor(rng.normal(size=(48, 16)), dtype=torch.float32).to(torch.float8_e5m2)
    scales = torch.tensor(0.5), torch.tensor(0.25)
    fp8 = fp8_torch.scaled_mm(a, b, *scales, "float32", torch.float32)
    dequantized = fp8_torch.dequantized_mm(a, b, *scales, "float32", torch.float32)
    torch.testing.assert_close(dequantized, fp8, rtol=1e-6, atol=1e-5)
