"""Which forms of an FP8 matmul does XLA's GPU compiler turn into FP8 GEMMs?

The H100 lease of 2026-11-27 found no FP8 GEMM in the optimized train step
of O2 float8 (Keras's float8 layers): the layers quantized and dequantized
around bfloat16 dots. This probe compiles one matmul in each form, forward
and backward, and reads the optimized program: the GEMM calls and fusions
whose operands are FP8, and the dots left in bfloat16; then times each (ms,
median of 20). On a machine without FP8 GEMMs (a CPU) it says what the
compiler did there.

    KERAS_BACKEND=jax python benchmarks/fp8_probe.py [--m 8192 --k 4096 --n 4096]
"""

import argparse
import os
import re
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BF16, F32 = jnp.bfloat16, jnp.float32


def _qdq(x, scale, f8, dtype):
    """Keras's `quantizers.quantize_and_dequantize`, written out."""
    info = jnp.finfo(f8)
    q = jnp.clip(x / scale.astype(dtype), float(info.min), float(info.max)).astype(f8)
    return q.astype(dtype) * scale.astype(dtype)


def _quantize(x, scale, f8):
    info = jnp.finfo(f8)
    return jnp.clip(x.astype(F32) / scale, float(info.min), float(info.max)).astype(f8)


def forms():
    """name -> f(x, w, sx, sw): forward matmuls of (m, k) x (k, n)."""

    def keras_bf16(x, w, sx, sw):  # Keras's float8 Dense at mixed_bfloat16
        return _qdq(x, sx, E4M3, BF16) @ _qdq(w, sw, E4M3, BF16)

    def dequant_f32(x, w, sx, sw):  # dequantized in float32, the dot in bfloat16
        qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
        return (qx.astype(F32) * sx).astype(BF16) @ (qw.astype(F32) * sw).astype(BF16)

    def dot_f32_out(x, w, sx, sw):  # dequantized in float32, a float32 dot
        qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
        return ((qx.astype(F32) * sx) @ (qw.astype(F32) * sw)).astype(BF16)

    def direct(x, w, sx, sw):  # FP8 operands into the dot, scaled after
        qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
        y = jax.lax.dot_general(qx, qw, (((1,), (0,)), ((), ())), preferred_element_type=BF16)
        return y * (sx * sw).astype(BF16)

    return {
        "keras qdq (bfloat16)": keras_bf16,
        "dequantize in float32": dequant_f32,
        "float32 dot": dot_f32_out,
        "fp8 operands, scaled after": direct,
    }


def _keras_layer(kind, m, k, n):
    """A Keras float8 layer at mixed_bfloat16: f(params, x) -> loss, its params."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    if kind == "Dense":
        layer = keras.layers.Dense(n, use_bias=False)
        shape = (m, k)
    else:  # an attention projection: (batch, tokens, width) -> (batch, tokens, heads, head)
        layer = keras.layers.EinsumDense("btd,dnh->btnh", (None, 8, n // 8))
        shape = (m // 512, 512, k)
    layer.build(shape)
    layer.quantize("float8")
    keras.mixed_precision.set_global_policy("float32")
    trainable = [v.value for v in layer.trainable_variables]
    other = [v.value for v in layer.non_trainable_variables]

    def loss(trainable, x):
        y, _ = layer.stateless_call(trainable, other, x, training=True)
        return jnp.sum(jnp.square(y.astype(F32)))

    return loss, trainable, shape


def census(compiled_text):
    """FP8 GEMMs, FP8 fusions and half dots in an optimized HLO module."""
    f8 = re.compile(r"f8e4m3fn|f8e5m2")
    calls = [
        line
        for line in compiled_text.splitlines()
        if "custom-call(" in line and ("matmul" in line or "gemm" in line.lower())
    ]
    # cuBLASLt's FP8 GEMM is its own target; operands' types are not always printed.
    fp8_calls = [c for c in calls if "$f8" in c or f8.search(c.split("custom-call(")[1])]
    target = re.compile(r'custom_call_target="([^"]+)"')
    targets = sorted({m.group(1) for c in calls for m in [target.search(c)] if m})
    triton_f8 = sum(
        1
        for line in compiled_text.splitlines()
        if "fusion(" in line and "triton" in line and f8.search(line.split("fusion(")[1])
    )
    dots = [line for line in compiled_text.splitlines() if re.search(r"= \S+ dot\(", line)]
    f8_dots = [d for d in dots if f8.search(d.split("dot(")[1])]
    return (
        f"fp8 GEMM calls {len(fp8_calls)}/{len(calls)}, fp8 triton fusions {triton_f8}, "
        f"dots {len(dots)} (fp8 operands {len(f8_dots)}), targets {targets}"
    )


def _time(f, *args, n=20):
    out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    args = parser.parse_args()
    m, k, n = args.m, args.k, args.n
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), BF16)
    sx, sw = jnp.float32(4.0 / 448), jnp.float32(0.2 / 448)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; ({m}, {k}) x ({k}, {n})")
    plain = jax.jit(lambda x, w: x @ w)
    print(f"| bfloat16 dot | forward | {_time(plain, x, w):.3f} ms | "
          f"{census(plain.lower(x, w).compile().as_text())} |", flush=True)  # fmt: skip
    for name, f in forms().items():
        for direction in ("forward", "backward"):
            try:
                if direction == "forward":
                    g = jax.jit(f)
                else:
                    g = jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a).astype(F32)), (0, 1)))
                text = g.lower(x, w, sx, sw).compile().as_text()
                ms = _time(g, x, w, sx, sw)
                print(f"| {name} | {direction} | {ms:.3f} ms | {census(text)} |", flush=True)
            except Exception as e:  # a form the compiler refuses: said
                print(f"| {name} | {direction} | failed | {type(e).__name__}: {str(e)[:120]} |")
    for kind in ("Dense", "EinsumDense"):
        try:
            loss, params, shape = _keras_layer(kind, m, k, n)
            xs = jnp.asarray(rng.standard_normal(shape), F32)
            forward = jax.jit(loss)
            backward = jax.jit(jax.grad(loss, (0, 1)))
            for direction, g in (("forward", forward), ("backward", backward)):
                text = g.lower(params, xs).compile().as_text()
                print(f"| Keras float8 {kind} | {direction} | {_time(g, params, xs):.3f} ms | "
                      f"{census(text)} |", flush=True)  # fmt: skip
        except Exception as e:
            print(f"| Keras float8 {kind} | | failed | {type(e).__name__}: {str(e)[:160]} |")


if __name__ == "__main__":
    main()
