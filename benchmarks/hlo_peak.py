"""(For contributors) what is alive at a compiled step's peak, and what
differs from another program's peak.

Reads the scheduled HLO XLA dumps after its optimizations (the entry
computation's order is the order it runs in) and walks it once: each value
lives from the instruction that makes it to its last reader (a
get-tuple-element, bitcast or tuple is its source's alias; parameters,
constants and the program's outputs are not temporaries). The peak of the
sum is close to what `memory_analysis().temp_size_in_bytes` reports (the
issue 65 BERT on JAX's CPU: 459.9 against 458.4 MiB, 485.2 against 485.2),
but names the values: which tensors, of which shape and dtype, a step holds
where another holds less. How issue 65's float32 copies of the kept
probabilities were found.

    XLA_FLAGS="--xla_dump_to=/tmp/a --xla_dump_hlo_as_text" \\
        KERAS_BACKEND=jax python my_step.py          # one configuration
    XLA_FLAGS="--xla_dump_to=/tmp/b --xla_dump_hlo_as_text" ...    # another
    python benchmarks/hlo_peak.py \\
        /tmp/a/*jit_train_step.cpu_after_optimizations.txt \\
        /tmp/b/*jit_train_step.cpu_after_optimizations.txt
"""

import argparse
import collections
import re

BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
    "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
ALIASES = ("get-tuple-element", "bitcast", "tuple")
NOT_TEMPORARY = ("parameter", "constant")
OUTPUT = float("inf")


def bytes_of(shape):
    """The bytes of every array in an HLO shape (a tuple's elements summed)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]", shape):
        if dtype in BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * BYTES[dtype]
    return total


def _entry(path):
    lines, inside = [], False
    for line in open(path).read().split("\n"):
        if line.startswith("ENTRY"):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line.strip())
    return lines


def peak(path):
    """`(peak_bytes, live)`: `live` holds `(bytes, name, opcode, shape)` of
    each temporary alive at the peak, largest first."""
    lines = _entry(path)
    made, alias, last = {}, {}, collections.defaultdict(int)
    for i, line in enumerate(lines):
        m = re.match(r"(ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$", line)
        if not m:
            continue
        root, name, shape, opcode, rest = m.groups()
        operands = rest.split("), ")[0] if "), " in rest else rest
        sources = set()
        for operand in re.findall(r"%([\w.\-]+)", operands):
            sources |= alias.get(operand, {operand})
        if opcode in ALIASES:
            alias[name] = sources
        else:
            size = 0 if opcode in NOT_TEMPORARY else bytes_of(shape)
            made[name] = (i, size, opcode, shape.split(" /*")[0])
        for source in sources:
            last[source] = max(last[source], i)
        if root:
            for source in alias.get(name, {name}):
                last[source] = OUTPUT
    delta = collections.Counter()
    for name, (i, size, _, _) in made.items():
        end = last.get(name, i)
        if end != OUTPUT:
            delta[i] += size
            delta[end + 1] -= size
    alive, top, at = 0, 0, 0
    for i in range(len(lines) + 1):
        alive += delta[i]
        if alive > top:
            top, at = alive, i
    live = [
        (size, name, opcode, shape)
        for name, (i, size, opcode, shape) in made.items()
        if i <= at <= last.get(name, i) != OUTPUT and size
    ]
    return top, sorted(live, reverse=True)


def _kind(shape):
    return re.sub(r"\{[0-9,]*\}", "", shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("programs", nargs="+", help="*_after_optimizations.txt, one or two")
    parser.add_argument("--top", type=int, default=20, help="largest values listed")
    parser.add_argument("--min-bytes", type=int, default=2**18, help="smallest difference listed")
    args = parser.parse_args()
    peaks = []
    for path in args.programs[:2]:
        top, live = peak(path)
        peaks.append(live)
        print(f"{path}: peak {top / 2**20:.1f} MiB")
        by_dtype = collections.Counter()
        for size, _, _, shape in live:
            by_dtype[shape.split("[")[0].lstrip("(")] += size
        print("  by dtype: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in by_dtype.items()))
        for size, name, opcode, shape in live[: args.top]:
            print(f"  {size / 2**20:8.2f} MiB  {name} ({opcode}) {shape[:70]}")
    if len(peaks) == 2:
        first, second = (collections.Counter((_kind(s), n) for n, _, _, s in p) for p in peaks)
        print("alive at the second's peak, not at the first's (count x MiB shape):")
        for kind, size in sorted(set(first) | set(second), key=lambda k: -k[1]):
            more = second[(kind, size)] - first[(kind, size)]
            if more and abs(more) * size >= args.min_bytes:
                print(f"  {more:+d} x {size / 2**20:.2f} {kind}")


if __name__ == "__main__":
    main()
