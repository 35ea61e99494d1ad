"""Matmuls and convolutions in an XLA HLO module's text, with their dtypes
and FLOPs: the program JAX lowers a train step to (and, on a GPU, the one
XLA's passes make of it, where dots become cuBLAS calls).

Counted: `dot` and `convolution` instructions wherever they are (fused
computations too: a Triton GEMM is a fusion holding a dot), cuBLAS GEMM and
cuDNN convolution custom calls. A dot's FLOPs are 2 x its output's elements
x its contracted size (a dot with a vector is a reduction, a sum or a
norm, and not counted); a convolution's 2 x its forward output's elements x
the taps each sums (its filter's elements over its output features). A
loop's body counts once. Also counted: the kernels that do nothing but
convert (a cast XLA could not fuse into a neighbour), and the bytes they
write.
"""

import collections
import re

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "f32": 4, "s32": 4}
# What a kernel that only converts may also hold.
_MOVES = {"parameter", "bitcast", "reshape", "transpose", "copy", "broadcast", "tuple"}
_MOVES |= {"get-tuple-element", "constant", "slice", "convert"}
DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}
# An FP8 GEMM's operands (after XLA's rewrite on a GPU).
DTYPES.update({"f8e4m3fn": "float8", "f8e5m2": "float8"})
# What carries an FP8-dequantized value on to a dot unchanged but for its
# scale (Keras's quantize-dequantize: convert to f8, convert back, multiply).
_CARRIES = {"multiply", "transpose", "reshape", "bitcast", "copy"}


def _arrays(text):
    """[(dtype, [dims])] of the arrays written in `text`, in order."""
    return [
        (dtype, [int(d) for d in filter(None, dims.split(","))])
        for dtype, dims in _ARRAY.findall(text)
    ]


def largest_array(text):
    """The elements of the largest floating-point array written in HLO
    `text` (any instruction's result or operand, in any computation: a
    loop's body holds one chunk's)."""
    return max((_product(dims) for dtype, dims in _arrays(text) if dtype in DTYPES), default=0)


def _product(values):
    total = 1
    for value in values:
        total *= value
    return total


def _dims(text, key):
    """The integers of `key={1,2}` or `"key":["1","2"]` in `text`."""
    match = re.search(key + r'(?:=\{|":\[)([^}\]]*)', text)
    if not match:
        return []
    return [int(d.strip('" ')) for d in match.group(1).split(",") if d.strip('" ')]


def _operands(arguments, shapes):
    """The arrays of an instruction's operands (written beside each, or the
    shapes of the instructions it names), their names, and the text after
    them."""
    depth, end = 1, 0
    for end, char in enumerate(arguments):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    listed = arguments[:end]
    arrays = _arrays(listed)
    names = [n for n in re.findall(r"%?([\w.\-]+)", _ARRAY.sub("", listed)) if n in shapes]
    if not arrays:
        arrays = [shapes[name] for name in names]
    return arrays, names, arguments[end:]


def _conv_flops(output, operands, attributes, form):
    labels = re.search(r"dim_labels=\w+_(\w+)->\w+", attributes)
    if not labels or len(operands) < 2:
        return 0
    # (filter, forward output) of each form of a convolution.
    kernel, forward_output = {
        "forward": (operands[1], output),
        "backward_input": (operands[1], operands[0]),
        "backward_filter": (output, operands[1]),
    }[form]
    out_features = kernel[1][labels.group(1).index("o")]
    return 2 * _product(forward_output[1]) * _product(kernel[1]) // max(out_features, 1)


def _dot_flops(output, operands, attributes, key):
    contracted = _product(operands[0][1][d] for d in _dims(attributes, key))
    return 2 * _product(output[1]) * contracted


def census(text):
    """`(matmuls, converts, convert_bytes)` of an HLO module's text:
    `matmuls` a list of `(kind, dtype, flops)` ("dot" or "convolution"; the
    dtype of the first operand, "float16 x float32" when the two differ;
    "float8" for a dot of two FP8 operands, or of two values dequantized
    from FP8, the pattern XLA rewrites into an FP8 GEMM on a GPU)."""
    matmuls = []
    computations, current, shapes, fusions = {}, None, {}, []
    dequantized = set()  # names of values dequantized from FP8 (scaled, moved)
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
        operands, names, attributes = _operands(rest, shapes)
        kind, flops = None, 0
        if (op == "convert" and operands and DTYPES.get(operands[0][0]) == "float8") or (
            op in _CARRIES and any(n in dequantized for n in names)
        ):
            dequantized.add(name)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", attributes)
            if called:
                fusions.append((shape, called.group(1)))
        elif op == "dot" and len(operands) >= 2 and min(len(o[1]) for o in operands[:2]) >= 2:
            kind, flops = "dot", _dot_flops(output, operands, attributes, "lhs_contracting_dims")
        elif op == "convolution" and len(operands) >= 2:
            kind, flops = "convolution", _conv_flops(output, operands, attributes, "forward")
        elif op == "custom-call" and len(operands) >= 2:
            target = re.search(r'custom_call_target="([^"]+)"', attributes)
            target = target.group(1) if target else ""
            if target in _GEMMS:
                key = "lhs_contracting_dimensions"
                kind, flops = "dot", _dot_flops(output, operands, attributes, key)
            elif target.startswith("__cudnn$conv"):
                form = "forward"
                if "BackwardInput" in target:
                    form = "backward_input"
                elif "BackwardFilter" in target:
                    form = "backward_filter"
                kind, flops = "convolution", _conv_flops(output, operands, attributes, form)
        if kind is not None:
            fp8 = len(names) >= 2 and all(n in dequantized for n in names[:2])
            matmuls.append((kind, "float8" if fp8 else _dtype_of(operands), flops))
    converts = collections.Counter()
    for shape, called in fusions:
        ops = set(computations.get(called, ()))
        if "convert" in ops and ops <= _MOVES:
            converts["kernels"] += 1
            converts["bytes"] += sum(
                _BYTES.get(dtype, 4) * _product(dims) for dtype, dims in _arrays(shape)
            )
    return matmuls, converts["kernels"], converts["bytes"]


def _dtype_of(operands):
    first, second = (DTYPES.get(dtype, dtype) for dtype, _ in operands[:2])
    return first if first == second else f"{first} x {second}"
