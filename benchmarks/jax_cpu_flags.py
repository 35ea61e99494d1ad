"""(For contributors) Which of XLA's CPU options makes JAX's bfloat16 matmul fast?

JAX compiles a matmul with XLA's own CPU emitter, where TensorFlow and
PyTorch call oneDNN: on a CPU with AVX512-BF16 a bfloat16 matmul ran at
1.4x float32's rate on JAX against 3.3x on TensorFlow (issue 64). XLA has
options that route dots elsewhere (oneDNN, XNNPACK, YNNPACK); this times a
matmul in float32, bfloat16 and float16 under each, one process per option
(XLA reads `XLA_FLAGS` once), medians of 7 runs after a warm-up.

    python benchmarks/jax_cpu_flags.py --size 1024 2048
"""

import argparse
import os
import subprocess
import sys

OPTIONS = (
    "",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_custom_call=true",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_experimental_xnn_fusion_type=dot",
    "--xla_cpu_experimental_ynn_fusion_type=dot",
)

CHILD = """
import sys, time, statistics
import numpy as np, jax, jax.numpy as jnp
n = int(sys.argv[1])
rates = {}
for dtype in ("float32", "bfloat16", "float16"):
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.random((n, n)), dtype) for _ in range(2))
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        seconds.append(time.perf_counter() - start)
    rates[dtype] = 2 * n**3 / statistics.median(seconds) / 1e9
print(f"{rates['float32']:.0f} | {rates['bfloat16']:.0f} | {rates['float16']:.0f} "
      f"| {rates['bfloat16'] / rates['float32']:.2f}")
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs="+", default=[1024])
    args = parser.parse_args()
    print("| XLA_FLAGS | n | float32 GFLOP/s | bfloat16 | float16 | bfloat16 / float32 |")
    print("|---|---|---|---|---|---|")
    for n in args.size:
        for option in OPTIONS:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(n)],
                env={**os.environ, "XLA_FLAGS": option, "JAX_PLATFORMS": "cpu"},
                capture_output=True,
                text=True,
            )
            result = out.stdout.strip() or f"failed: {out.stderr.strip().splitlines()[-1]}"
            print(f"| `{option or '(none)'}` | {n} | {result} |", flush=True)


if __name__ == "__main__":
    main()
