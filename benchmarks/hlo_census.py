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


# -- matmul work by dtype (the optimized module of any platform) --------------

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_CONV_TARGET = "__cudnn$conv"
# Operations a kernel of nothing but converts may also hold.
_MOVES = {"parameter", "bitcast", "reshape", "transpose", "copy", "broadcast", "tuple"}
_MOVES |= {"get-tuple-element", "constant", "slice", "convert"}


def _arrays(text):
    """[(dtype, [dims])] of the arrays written in `text`, in order."""
    return [
        (dtype, [int(d) for d in filter(None, dims.split(","))])
        for dtype, dims in _ARRAY.findall(text)
    ]


def _prod(values):
    total = 1
    for v in values:
        total *= v
    return total


def _dims(text, key):
    """The integers of `key={1,2}` or `"key":["1","2"]` in `text`."""
    match = re.search(key + r'(?:=\{|":\[)([^}\]]*)', text)
    return [int(d.strip('" ')) for d in match.group(1).split(",") if d.strip('" ')] if match else []


def _operands(arguments, shapes):
    """The arrays of an instruction's operand list (up to its closing paren):
    written beside each operand, or else the shapes of the named operands."""
    depth, end = 1, 0
    for end, char in enumerate(arguments):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    listed = arguments[:end]
    arrays = _arrays(listed)
    if not arrays:
        names = re.findall(r"%?([\w.\-]+)", listed)
        arrays = [shapes[n] for n in names if n in shapes]
    return arrays, arguments[end:]


def _conv_flops(output, operands, attributes, kind="forward"):
    """2 x outputs x the taps each sums: for any of the three forms of a
    convolution, from the forward one's `dim_labels` (lhs_rhs->out)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attributes)
    if not labels or len(operands) < 2:
        return 0
    # (filter, forward output) of each form; the filter's input features
    # already count a grouped convolution's groups.
    kernel, y = {
        "forward": (operands[1], output),
        "backward_input": (operands[1], operands[0]),
        "backward_filter": (output, operands[1]),
    }[kind]
    out_features = kernel[1][labels.group(2).index("o")]
    return 2 * _prod(y[1]) * _prod(kernel[1]) // max(out_features, 1)


def matmul_census(text):
    """Matmul and convolution FLOPs by operand dtype, and the converts left
    as kernels of their own, in an HLO module's text (JAX's lowered or any
    platform's optimized module).

    Counted: `dot` and `convolution` instructions wherever they are (fused
    computations too: a Triton GEMM is a fusion holding a dot), cuBLAS GEMM
    and cuDNN convolution custom calls (what XLA rewrites them into on a
    GPU). A dot's FLOPs are 2 x its output's elements x its contracted
    size. Returns {"flops": {dtype: n}, "half_share": float,
    "converts": kernels that only convert, "convert MiB": their outputs}.
    """
    flops = collections.Counter()
    computations, current, shapes = {}, None, {}
    fusions = []  # (output shape, called computation) of each fusion kernel
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            current = computations.setdefault(head.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, op, rest = match.groups()
        if current is not None:
            current.append(op)
        output = (_arrays(shape) or [("", [])])[0]
        shapes[name] = output
        operands, attributes = _operands(rest, shapes)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", attributes)
            if called:
                fusions.append((shape, called.group(1)))
            continue
        if op == "dot" and len(operands) >= 2:
            contracted = _prod(operands[0][1][d] for d in _dims(attributes, "lhs_contracting_dims"))
            flops[_dtype(operands)] += 2 * _prod(output[1]) * contracted
        elif op == "convolution":
            flops[_dtype(operands)] += _conv_flops(output, operands, attributes)
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', attributes)
            target = target.group(1) if target else ""
            if target in _GEMM_TARGETS and len(operands) >= 2:
                lhs = _dims(attributes, "lhs_contracting_dimensions")
                contracted = _prod(operands[0][1][d] for d in lhs)
                flops[_dtype(operands)] += 2 * _prod(output[1]) * contracted
            elif target.startswith(_CONV_TARGET):
                kind = (
                    "backward_input"
                    if "BackwardInput" in target
                    else "backward_filter"
                    if "BackwardFilter" in target
                    else "forward"
                )
                flops[_dtype(operands)] += _conv_flops(output, operands, attributes, kind)
    converts, convert_bytes = 0, 0
    for shape, called in fusions:
        ops = set(computations.get(called, ()))
        if "convert" in ops and ops <= _MOVES:
            converts += 1
            convert_bytes += _bytes(shape)
    total = sum(flops.values())
    half = sum(n for dtype, n in flops.items() if dtype in ("f16", "bf16"))
    return {
        "flops": dict(flops),
        "half_share": half / total if total else 0.0,
        "converts": converts,
        "convert MiB": convert_bytes / 2**20,
    }


def _dtype(operands):
    """The dtype of a matmul's operands ("mixed" when its two differ)."""
    first, second = operands[0][0], operands[1][0]
    return first if first == second else f"{first}x{second}"


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
