"""Matmuls and convolutions in a traced TensorFlow graph, with their dtypes
and FLOPs: the train step `tf.function` traces (forward, the gradient tape's
backward, the optimizer), and the functions it calls (a `while` loop's
body, a `cond`'s branches), each counted once where referenced.

FLOPs from the operands' static shapes: `MatMul` 2MNK, `BatchMatMul` 2BMNK,
`Einsum` 2 x the product of every index's size, a convolution (any of its
three forms) 2 x its forward output's elements x the taps each sums.
A matmul of two values cast from FP8 and back (Keras's float8 layers) is
"float8": the pattern XLA rewrites into an FP8 GEMM on a GPU.
"""

import math

_MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
_FUNCTION_ATTRIBUTES = ("body", "cond", "then_branch", "else_branch", "f", "branches")
# op type: (forward input, filter, forward output) as operand indexes, -1 the op's output.
_CONVOLUTIONS = {
    "Conv1D": (0, 1, -1),
    "Conv2D": (0, 1, -1),
    "Conv3D": (0, 1, -1),
    "DepthwiseConv2dNative": (0, 1, -1),
    "Conv2DBackpropInput": (-1, 1, 2),
    "Conv3DBackpropInputV2": (-1, 1, 2),
    "DepthwiseConv2dNativeBackpropInput": (-1, 1, 2),
    "Conv2DBackpropFilter": (0, -1, 2),
    "Conv3DBackpropFilterV2": (0, -1, 2),
    "DepthwiseConv2dNativeBackpropFilter": (0, -1, 2),
}


def matmuls(graph):
    """`(kind, dtype, flops)` of each matmul ("dot") and convolution of
    `graph` and of the functions it calls."""
    return [entry for entry in map(_census, operations(graph)) if entry is not None]


def fp8_dots(graph):
    """`[(dtype, dtype)]` (sorted) of each matmul of `graph` and of the
    functions it calls whose two operands are FP8 themselves."""
    found = []
    for op in operations(graph):
        if op.type in _MATMULS + ("XlaDot", "XlaDotV2") and len(op.inputs) >= 2:
            dtypes = sorted(t.dtype.name for t in op.inputs[:2])
            if all(d.startswith("float8") for d in dtypes):
                found.append(tuple(dtypes))
    return found


def operations(graph):
    """The ops of `graph` and of the functions it calls, each function once."""
    seen, stack = set(), [graph]
    functions = getattr(graph, "_functions", {})
    while stack:
        for op in stack.pop().get_operations():
            yield op
            for name in _called(op):
                function = functions.get(name)
                if name not in seen and getattr(function, "graph", None) is not None:
                    seen.add(name)
                    stack.append(function.graph)


def largest_tensor(graph):
    """The elements of the largest floating-point tensor an op of `graph`
    (or of a function it calls: a loop's body) makes; static shapes, an
    unknown dimension counted as 1, an unknown rank not counted (a
    TensorArray's flow)."""
    return max(
        (
            math.prod(_shape(t))
            for op in operations(graph)
            for t in op.outputs
            if t.dtype.is_floating and t.shape.rank is not None
        ),
        default=0,
    )


# The gradient tape's ops, by the name scope TensorFlow gives them.
_GRADIENT_SCOPE = "gradient_tape/"
# Ops that read only their input's shape (known statically: nothing kept).
_SHAPE_ONLY = ("Shape", "ShapeN", "Size", "Rank")
# Values that are not the forward pass's: variables, constants, the batch.
_NOT_COMPUTED = ("ReadVariableOp", "Const", "Placeholder", "VarHandleOp")


def saved_for_backward(graph):
    """`{dtype: bytes}` of the forward pass's floating values that the
    gradient's ops read (what the backward pass keeps), each once; static
    shapes, an unknown dimension counted as 1."""
    saved, seen = {}, set()
    for op in graph.get_operations():
        if not op.name.startswith(_GRADIENT_SCOPE) or op.type in _SHAPE_ONLY:
            continue
        for tensor in op.inputs:
            producer = tensor.op
            if producer.name.startswith(_GRADIENT_SCOPE) or producer.type in _NOT_COMPUTED:
                continue
            if tensor.name in seen or not tensor.dtype.is_floating:
                continue
            seen.add(tensor.name)
            size = math.prod(_shape(tensor)) * tensor.dtype.size
            saved[tensor.dtype.name] = saved.get(tensor.dtype.name, 0) + size
    return saved


def _called(op):
    names = []
    for attribute in _FUNCTION_ATTRIBUTES:
        try:
            value = op.get_attr(attribute)
        except ValueError:
            continue
        for function in value if isinstance(value, list) else [value]:
            name = getattr(function, "name", None)
            if name:
                names.append(name.decode() if isinstance(name, bytes) else name)
    return names


def _shape(tensor):
    return [d if d is not None else 1 for d in tensor.shape.as_list()]


def _census(op):
    if op.type in _MATMULS:
        a, b = (_shape(t) for t in op.inputs[:2])
        if min(len(a), len(b)) < 2:
            return None  # a dot with a vector: a reduction
        if op.type == "Einsum":
            flops = 2 * _einsum_size(op.get_attr("equation").decode(), a, b)
        elif op.type == "MatMul":
            m = a[1] if op.get_attr("transpose_a") else a[0]
            k = a[0] if op.get_attr("transpose_a") else a[1]
            n = b[0] if op.get_attr("transpose_b") else b[1]
            flops = 2 * m * n * k
        else:
            adjoint_x = op.get_attr("adj_x")
            k = a[-2] if adjoint_x else a[-1]
            flops = 2 * math.prod(_shape(op.outputs[0])) * k
        if all(_dequantized(t) for t in op.inputs[:2]):
            return "dot", "float8", flops
        return "dot", _dtype(op.inputs[0]), flops
    if op.type in _CONVOLUTIONS:
        _, kernel, output = (
            op.outputs[0] if i == -1 else op.inputs[i] for i in _CONVOLUTIONS[op.type]
        )
        shape = _shape(kernel)
        # [..., in, out]: each output element sums all but the output
        # features; a depthwise one its own channel's taps.
        taps = math.prod(shape[:-2] if op.type.startswith("Depthwise") else shape[:-1])
        return "convolution", _dtype(output), 2 * math.prod(_shape(output)) * taps
    return None


# What carries a value dequantized from FP8 on to a matmul unchanged but
# for its scale (Keras's quantize-dequantize: cast to float8, cast back,
# multiply by the scale).
_CARRIES = ("Mul", "Identity", "Transpose", "Reshape")


def _dequantized(tensor, depth=4):
    """Whether `tensor` is a value cast from FP8 (scaled or moved)."""
    op = tensor.op
    if op.type == "Cast" and op.inputs[0].dtype.name.startswith("float8"):
        return True
    if op.type == "IdentityN" and depth:  # a custom gradient's forward: output i is input i
        return _dequantized(op.inputs[tensor.value_index], depth - 1)
    return (
        bool(depth)
        and op.type in _CARRIES
        and any(_dequantized(t, depth - 1) for t in op.inputs if t.dtype.is_floating)
    )


def _einsum_size(equation, a, b):
    """The product of every index's size (an ellipsis's dimensions too):
    each output element sums over the contracted indices."""
    sizes = {}
    for labels, shape in zip(equation.split("->")[0].split(","), (a, b)):
        explicit = labels.replace("...", "")
        if "..." in labels:
            broadcast = shape[: len(shape) - len(explicit)]
            for i, size in enumerate(reversed(broadcast)):
                sizes[f"...{i}"] = max(size, sizes.get(f"...{i}", 1))
        for label, size in zip(explicit[::-1], shape[::-1]):
            sizes[label] = max(size, sizes.get(label, 1))
    return math.prod(sizes.values())


def _dtype(tensor):
    return tensor.dtype.name
