"""JAX's FP8 GEMM (`fp8_jax.gemm`, a custom VJP around a dot of FP8
operands): the einsum and both its gradients within FP8's rounding of
float32's (E4M3 forward, the E5M2 output gradient backward), on an
equation that permutes its axes, and the amax histories' new values handed
out as their gradients. Its StableHLO dots: `fp8_dots`."""

import keras
import numpy as np
import pytest

from keras_mp._src.backends import fp8_common

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's own GEMM")


def _relative(got, want):
    return np.linalg.norm(np.asarray(got, "float32") - want) / np.linalg.norm(want)


def test_the_gemm_and_its_gradients_follow_float32_within_fp8_rounding():
    import jax
    import jax.numpy as jnp

    from keras_mp._src.backends import fp8_jax

    rng = np.random.default_rng(0)
    x, k, g = (
        rng.normal(size=s).astype("float32") for s in [(2, 16, 32), (32, 2, 16), (2, 16, 2, 16)]
    )
    form = fp8_common.gemm_form("btd,dnh->btnh", 3)
    state = [np.abs(x).max() / 448, np.zeros(4), np.abs(k).max() / 448, np.zeros(4)]
    state += [np.abs(g).max() / 57344, np.zeros(4)]
    state = [jnp.asarray(s, "float32") for s in state]

    def forward_and_back(x, k, state, g):
        gemm = lambda x, k, s: fp8_jax.gemm(form, x, k, s, True, "float32")  # noqa: E731
        y, vjp = jax.vjp(gemm, x, k, state)
        return y, vjp(g)

    y, (dx, dk, ds) = jax.jit(forward_and_back)(x, k, state, jnp.asarray(g))
    assert _relative(y, np.einsum("btd,dnh->btnh", x, k)) < 2**-4
    assert _relative(dx, np.einsum("btnh,dnh->btd", g, k)) < 2**-3
    assert _relative(dk, np.einsum("btd,btnh->dnh", x, g)) < 2**-3
    np.testing.assert_allclose([ds[1][0], ds[3][0], ds[5][0]], [abs(a).max() for a in (x, k, g)])


def test_fp8_dots_reads_the_operands_of_stablehlo_dots():
    from keras_mp._src.backends import fp8_jax

    text = (
        "%0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : "
        "(tensor<32x64xf8E5M2>, tensor<64x48xf8E4M3FN>) -> tensor<32x48xf32>\n"
        "%1 = stablehlo.dot_general %c, %d, contracting_dims = [1] x [0] : "
        "(tensor<32x64xbf16>, tensor<64x48xbf16>) -> tensor<32x48xf32>"
    )
    assert fp8_jax.fp8_dots(text) == [("float8_e4m3fn", "float8_e5m2")]
