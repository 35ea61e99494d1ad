"""What XLA compiles `fit`'s train step into, per configuration (JAX).

A profile without a timer: for each configuration of `amp_levels.py` (the
same models), `fit` runs two steps with XLA's dumps on, in a process of its
own, and the optimized train step's entry computation is counted: the
operations that launch work (fusions, dots, convolutions, custom calls,
copies...), and the copies with the bytes they move. Copies of whole
buffers are what a step should not have: each reads and writes a weight,
a slot or a master copy once more per step. On a GPU the same census says
where the kernels and bytes of one configuration go that another's do not.

    KERAS_BACKEND=jax python benchmarks/hlo_census.py --models mlp
    KERAS_BACKEND=jax python benchmarks/hlo_census.py --models mlp_large --batch 2048 \\
        --configs O0 "O2 float16" "keras mixed_float16"

`KERAS_MP_JAX_SKIP_FORM=select` (or `cond`) compiles keras_mp's step in that
form of the skip whatever the device (a GPU's form on a CPU).
"""

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

import _checkout  # noqa: F401 (this checkout's keras_mp first)
import amp_levels

CONFIGS = ("O0", "O2 float16", "keras mixed_float16", "O2 bfloat16", "keras mixed_bfloat16")
# Operations that launch no work of their own.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all"}
_OP = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "f32": 4, "s32": 4}
_BYTES.update({"u32": 4, "f64": 8, "s64": 8, "u64": 8})


def _bytes(shape):
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += _BYTES.get(dtype, 4) * count
    return total


def census(path):
    """Counts of the optimized module's entry computation at `path`."""
    text = open(path).read()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops, copy_bytes, state_bytes = collections.Counter(), 0, 0
    for line in entry.splitlines():
        match = _OP.match(line)
        if not match:
            continue
        shape, op = match.groups()
        ops[op] += 1
        if op == "copy":
            copy_bytes += _bytes(shape)
        elif op == "parameter":
            state_bytes += _bytes(shape)
    launches = sum(n for op, n in ops.items() if op not in _FREE)
    return {
        "launches": launches,
        "fusions": ops["fusion"],
        "copies": ops["copy"],
        "copied MiB": copy_bytes / 2**20,
        "inputs MiB": state_bytes / 2**20,
    }


def matmul_census(text):
    """Matmul and convolution FLOPs by dtype in an HLO module's text (JAX's
    lowered module, or any platform's optimized one: `backends/hlo_text.py`
    reads cuBLAS and cuDNN calls too), their share in half, and the kernels
    that only convert. Returns {"flops": {dtype: n}, "half_share": float,
    "converts": n, "convert MiB": float}."""
    from keras_mp._src.backends import hlo_text

    matmuls, converts, convert_bytes = hlo_text.census(text)
    flops = collections.Counter()
    for _, dtype, n in matmuls:
        flops[dtype] += n
    total = sum(flops.values())
    half = sum(n for dtype, n in flops.items() if dtype in ("float16", "bfloat16"))
    return {
        "flops": dict(flops),
        "half_share": half / total if total else 0.0,
        "converts": converts,
        "convert MiB": convert_bytes / 2**20,
    }


def _one(config, model_name, batch, dump):
    """In a fresh process: two steps of `fit`, XLA dumping to `dump`."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    )
    import keras
    import numpy as np

    import keras_mp

    model, shape = amp_levels._compiled(keras, keras_mp, model_name, config)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * batch,) + shape).astype("float32")
    y = rng.integers(0, 10, size=(2 * batch,))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)


def _optimized_train_step(dump):
    # The platform's optimized module (`cpu_`/`gpu_after_optimizations.txt`).
    paths = glob.glob(os.path.join(dump, "*jit_train_step*after_optimizations.txt"))
    if not paths:
        raise RuntimeError(f"no optimized train step was dumped in {dump}")
    return max(paths, key=os.path.getmtime)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = amp_levels.MODELS + amp_levels.GPU_MODELS
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=models)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=amp_levels.CONFIGS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--one", nargs=3, metavar=("CONFIG", "MODEL", "DUMP"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be a positive number of samples, got {args.batch}")
    if args.one:
        return _one(args.one[0], args.one[1], args.batch, args.one[2])
    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        parser.error("XLA's dumps of a JAX step: run with KERAS_BACKEND=jax")
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    columns = ("launches", "fusions", "copies", "copied MiB", "inputs MiB")
    print("| model | configuration | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for model_name in args.models:
        for config in args.configs:
            with tempfile.TemporaryDirectory() as dump:
                command = [sys.executable, __file__, "--batch", str(args.batch)]
                command += ["--one", config, model_name, dump]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"| {model_name} | {config} | failed: {done.stderr.strip()[-200:]} |")
                    continue
                counts = census(_optimized_train_step(dump))
            cells = [f"{counts[c]:.1f}" if "MiB" in c else str(counts[c]) for c in columns]
            print(f"| {model_name} | {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
