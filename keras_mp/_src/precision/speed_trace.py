"""One symbolic forward pass, and the work of each layer call in it.

`trace(model, x)` runs the model on `x`'s shapes (`compute_output_spec`: no
arithmetic, nothing of the model changed) with each layer's `call` noting
what it was given and what it returned. `work(call)` is a call's own
matmul-like work: the forward FLOPs of its matmuls, einsums, convolutions,
attention and recurrences (a layer's sublayers are their own calls, so
nothing is counted twice), and the dimensions a 16-bit tensor core wants
as multiples of 8: the contracted ones and the output ones. A layer whose
work no rule below knows (T5's attention, a mixture of experts' experts, a
layer of your own) counts the matmuls and einsums its own `call` runs,
noted as they run in the trace.
"""

import dataclasses
import inspect
import math

import keras
import numpy as np

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import is_attention

ALIGNMENT = 8


@dataclasses.dataclass
class Call:
    """One call of a layer in the traced forward pass."""

    layer: object
    arguments: dict  # the call's arguments by name (tensors as shapes)
    inputs: list  # (shape, dtype, id) of each floating tensor it was given
    outputs: list  # (shape, dtype, id) of each floating tensor it returned
    raw: list = dataclasses.field(default_factory=list)  # `Work` of its own matmuls and einsums


@dataclasses.dataclass
class Work:
    """A call's own matmul-like work: forward FLOPs, and the dimensions
    (label, size) that 16-bit tensor cores want as multiples of 8."""

    flops: int = 0
    dims: tuple = ()


def trace(model, x):
    """The calls of `model`'s layers on `x`, in the order they ran."""
    calls, running = [], []
    hooked = []
    for layer in layer_tree.layers_in_order(model):
        if layer is model or layer_tree.is_graph(layer) or not hasattr(layer, "call"):
            continue
        # A quantized layer (Keras's float8 Dense) runs `quantized_call`.
        method = "quantized_call" if layer.dtype_policy.quantization_mode else "call"
        hooked.append((layer, method, layer.__dict__.get(method)))
        object.__setattr__(layer, method, _noting(layer, getattr(layer, method), calls, running))
    # Each attempt at the forward pass starts the record again: PyTorch's
    # `compute_output_spec` runs it on meta tensors, and again on real ones
    # where an op has no meta kernel (a cast to float8).
    hooked.append((model, "call", model.__dict__.get("call")))
    object.__setattr__(model, "call", _restarting(model.call, calls))
    numpy = keras_internals.backend_numpy
    ops = {name: getattr(numpy, name) for name in ("matmul", "einsum")}
    setattr(numpy, "matmul", _recording(ops["matmul"], _matmul_work, running))
    setattr(numpy, "einsum", _recording(ops["einsum"], _einsum_work, running))
    try:
        spec = keras.tree.map_structure(
            lambda a: keras.KerasTensor(tuple(a.shape), keras.backend.standardize_dtype(a.dtype)),
            x,
        )
        keras_internals.compute_output_spec(model, spec)
    finally:
        for name, op in ops.items():
            setattr(numpy, name, op)
        for layer, method, own in hooked:
            if own is None:
                layer.__dict__.pop(method, None)
            else:
                object.__setattr__(layer, method, own)
    return calls


def _restarting(call, calls):
    def call_restarting(*args, **kwargs):
        del calls[:]
        return call(*args, **kwargs)

    return call_restarting


def _floats(structure):
    found = []
    for t in keras.tree.flatten(structure):
        dtype = getattr(t, "dtype", None)
        if dtype is None or not hasattr(t, "shape"):
            continue
        dtype = keras.backend.standardize_dtype(dtype)
        if keras.backend.is_float_dtype(dtype):
            found.append((tuple(int(d) for d in t.shape), dtype, id(t)))
    return found


def _noting(layer, call, calls, running):
    try:
        signature = inspect.signature(call)
    except (TypeError, ValueError):
        signature = None

    def call_noting(*args, **kwargs):
        raw = []
        running.append(raw)
        try:
            outputs = call(*args, **kwargs)
        finally:
            running.pop()
        arguments = {}
        if signature is not None:
            try:
                arguments = dict(signature.bind(*args, **kwargs).arguments)
            except TypeError:
                arguments = {}
        calls.append(Call(layer, arguments, _floats((args, kwargs)), _floats(outputs), raw))
        return outputs

    return call_noting


def _recording(op, measure, running):
    """The backend's `op`, noting its `Work` in the layer call running it."""

    def recorded(*args, **kwargs):
        if running:
            try:
                running[-1].append(measure(*args, **kwargs))
            except (TypeError, ValueError, IndexError, AttributeError):
                pass  # a form this count does not read: left out
        return op(*args, **kwargs)

    return recorded


def _matmul_work(a, b, *_, **__):
    """`a @ b`: a dot with a vector is a reduction, not matmul work."""
    a, b = _shape(a), _shape(b)
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return Work()
    batch = math.prod(np.broadcast_shapes(a[:-2], b[:-2]))
    m, k, n = a[-2], a[-1], b[-1]
    return Work(2 * batch * m * k * n, (("contracted", k), ("output", n)))


def _einsum_work(equation, *operands, **_):
    """2 x the product of every index's size (an ellipsis's too)."""
    shapes = [_shape(o) for o in operands]
    specs = equation.replace(" ", "").split("->")[0].split(",")
    if len(shapes) != 2 or None in shapes or len(specs) != 2:
        return Work()
    sizes = {}
    for spec, shape in zip(specs, shapes):
        explicit = spec.replace("...", "")
        if "..." in spec:
            for i, size in enumerate(reversed(shape[: len(shape) - len(explicit)])):
                sizes[f"...{i}"] = max(size, sizes.get(f"...{i}", 1))
        for label, size in zip(explicit[::-1], shape[::-1]):
            sizes[label] = max(size, sizes.get(label, 1))
    output = equation.replace(" ", "").split("->")[1] if "->" in equation else ""
    summed = [c for c in sizes if c.isalpha() and c not in output]
    if not summed:
        return Work()  # an outer or elementwise product: no matmul
    contracted = math.prod(sizes[c] for c in summed)
    return Work(2 * math.prod(sizes.values()), (("contracted", contracted),))


def _shape(value):
    return tuple(int(d) for d in value.shape) if hasattr(value, "shape") else None


def work(call):
    """The call's own `Work` (none for a layer without matmul-like work)."""
    layer = call.layer
    for kind, measure in _KINDS:
        if isinstance(layer, kind):
            return measure(call)
    if is_attention(layer):
        modelled = _attention_core(call)
        if modelled.flops:
            return modelled
    return Work(sum(w.flops for w in call.raw), next((w.dims for w in call.raw if w.dims), ()))


def _first_input(call):
    return call.inputs[0][0] if call.inputs else ()


def _dense(call):
    shape = _first_input(call)
    k, n = shape[-1], call.layer.units
    m = math.prod(shape[:-1])
    return Work(2 * m * k * n, (("input features", k), ("units", n), ("batch x positions", m)))


def _einsum_dense(call):
    layer = call.layer
    equation = layer.equation.replace(" ", "")
    inputs, output = equation.split("->")
    x_spec, k_spec = inputs.split(",")
    x_shape = _first_input(call)
    out_shape = call.outputs[0][0] if call.outputs else ()
    sizes = {}
    for spec, shape in (
        (x_spec, x_shape),
        (k_spec, tuple(layer.kernel.shape)),
        (output, out_shape),
    ):
        if "..." in spec:
            head, tail = spec.split("...")
            spec = head + "".join(chr(0x3B1 + i) for i in range(len(shape) - len(head) - len(tail)))
            spec += tail
        for letter, size in zip(spec, shape):
            sizes.setdefault(letter, int(size))
    # As one GEMM: the kernel's contracted letters are its K (heads x
    # head_dim flatten into one), its letters only in the output its N.
    contracted = math.prod(sizes[c] for c in k_spec if c in x_spec and c not in output)
    produced = math.prod(sizes[c] for c in k_spec if c in output and c not in x_spec)
    return Work(2 * math.prod(sizes.values()), (("contracted", contracted), ("output", produced)))


def _conv(call):
    layer = call.layer
    x_shape, out_shape = _first_input(call), call.outputs[0][0]
    channels_last = getattr(layer, "data_format", "channels_last") == "channels_last"
    spatial = (lambda s: s[1:-1]) if channels_last else (lambda s: s[2:])
    channels = (lambda s: s[-1]) if channels_last else (lambda s: s[1])
    batch, kernel = x_shape[0], math.prod(layer.kernel_size)
    c_in = channels(x_shape)
    if isinstance(layer, keras_internals.BaseDepthwiseConv):
        c_out = c_in * layer.depth_multiplier
        flops = 2 * batch * math.prod(spatial(out_shape)) * c_out * kernel
        return Work(flops, (("channels", c_in),))
    if isinstance(layer, keras_internals.BaseSeparableConv):
        c_mid = c_in * layer.depth_multiplier
        positions = batch * math.prod(spatial(out_shape))
        flops = 2 * positions * c_mid * (kernel + layer.filters)
        return Work(flops, (("input channels", c_mid), ("filters", layer.filters)))
    groups = getattr(layer, "groups", 1) or 1
    if isinstance(layer, keras_internals.BaseConvTranspose):
        positions = batch * math.prod(spatial(x_shape))
    else:
        positions = batch * math.prod(spatial(out_shape))
    flops = 2 * positions * layer.filters * kernel * (c_in // groups)
    return Work(flops, (("input channels", c_in // groups), ("filters", layer.filters)))


def _multi_head_attention(call):
    """Its own work: the scores and the weighted sum (its projections are
    EinsumDense sublayers, counted as theirs)."""
    layer = call.layer
    query = _shape(call.arguments.get("query"))
    value = _shape(call.arguments.get("value"))
    if query is None or value is None:
        return Work()
    heads, key_dim = layer.num_heads, layer.key_dim
    value_dim = layer.value_dim or key_dim
    batch = query[0]
    tq, tk = math.prod(query[1:-1]), math.prod(value[1:-1])
    flops = 2 * batch * heads * tq * tk * (key_dim + value_dim)
    return Work(flops, (("key_dim", key_dim), ("value_dim", value_dim), ("key positions", tk)))


def _attention_core(call):
    """KerasHub's attention layers (`...Attention`): scores and weighted sum
    over the sequence of their first input, from their head count and size."""
    layer = call.layer
    heads = next(
        (
            getattr(layer, a)
            for a in ("num_query_heads", "num_heads", "_num_heads")
            if hasattr(layer, a)
        ),
        None,
    )
    head_dim = next(
        (getattr(layer, a) for a in ("head_dim", "key_dim", "_key_dim") if hasattr(layer, a)),
        None,
    )
    shape = _first_input(call)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or len(shape) < 3:
        return Work()
    batch, positions = shape[0], math.prod(shape[1:-1])
    flops = 2 * batch * heads * positions * positions * 2 * head_dim
    return Work(flops, (("head_dim", head_dim), ("positions", positions)))


def _recurrent(call):
    """LSTM (4 gates), GRU (3), SimpleRNN (1): each step's input and state
    matmuls, over the sequence."""
    layer = call.layer
    shape = _first_input(call)
    if len(shape) != 3:
        return Work()
    gates = {"LSTMCell": 4, "GRUCell": 3}.get(type(layer.cell).__name__, 1)
    units = layer.cell.units
    batch, steps, features = shape
    flops = 2 * batch * steps * (features + units) * gates * units
    return Work(flops, (("input features", features), ("units", units)))


def _embedding(call):
    """A lookup is no matmul; KerasHub's `ReversibleEmbedding` called with
    `reverse=True` (tied logits) multiplies by the whole table."""
    if not call.arguments.get("reverse"):
        return Work()
    shape = _first_input(call)
    layer = call.layer
    m, hidden, vocabulary = math.prod(shape[:-1]), layer.output_dim, layer.input_dim
    return Work(2 * m * hidden * vocabulary, (("hidden", hidden), ("vocabulary", vocabulary)))


_KINDS = (
    (keras.layers.Dense, _dense),
    (keras.layers.EinsumDense, _einsum_dense),
    (keras_internals.BaseConv, _conv),
    (keras_internals.BaseConvTranspose, _conv),
    (keras_internals.BaseDepthwiseConv, _conv),
    (keras_internals.BaseSeparableConv, _conv),
    (keras.layers.MultiHeadAttention, _multi_head_attention),
    (keras.layers.RNN, _recurrent),
    (keras.layers.Embedding, _embedding),
)


def misaligned(dims):
    """The `(label, size)`s that are not multiples of 8."""
    return [(label, size) for label, size in dims if size % ALIGNMENT]
