"""What a level costs a train step, layer by layer: per layer at a level its
matmul work, casts and bytes (`accounts_at`, from one symbolic pass:
`speed_trace.py`), and a layer's time on a device's rates as a roofline
(`layer_seconds`). The speed report (`tools/speed_model.py`) and
`amp_level="auto"` (`auto_level.py`) share it."""

import dataclasses

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import float8
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import policies as policy_rules
from keras_mp._src.precision import speed_trace

_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def nbytes(dtype):
    """Bytes of one element of `dtype`."""
    return _BYTES.get(keras.backend.standardize_dtype(dtype), 4)


@dataclasses.dataclass
class Account:
    """A layer's share of the step at one precision."""

    layer: object
    dtype: str
    reason: str = ""
    matmul: str = ""  # the dtype of its matmul where not `dtype` ("float8")
    variables: str = "float32"  # its variables' dtype at this precision
    flops: int = 0
    dims: list = dataclasses.field(default_factory=list)
    casts: int = 0
    cast_bytes: int = 0
    cast_values: int = 0  # values its casts convert a step, forward and backward
    output_values: int = 0  # values its calls return (its elementwise work's size)
    moved: int = 0  # bytes its calls read and write, forward and backward
    kept: int = 0  # bytes of its outputs (and kernels' casts) kept for the backward pass
    # Its matmul FLOPs in a train step: per forward matmul, its weights'
    # gradient and its inputs' gradient; a first layer's inputs (the
    # model's, which train nothing) get no gradient, so 2 there. Per call: a
    # tied embedding's lookup takes the model's ids, its logits the hidden
    # states, whose gradient they compute.
    step_flops: int = 0


def accounts_at(model, calls, amp):
    """Per layer (in the order they first ran): work, casts and bytes at `amp`."""
    compute, reasons, policies = {}, {}, {}
    for layer, (policy_name, reason) in policy_rules.decide_all(model, amp):
        policy = keras.dtype_policies.get(policy_name) if policy_name else layer.dtype_policy
        compute[id(layer)] = keras.backend.standardize_dtype(policy.compute_dtype)
        reasons[id(layer)] = reason
        policies[id(layer)] = policy
    parents = {id(layer): parent for layer, parent in layer_tree.tree(model)}
    # The model's output layers return float32, whatever they compute in.
    outputs = {
        id(layer) for layer in layer_tree.output_layers(model) if not layer_tree.is_container(layer)
    }
    produced = {}  # tensor id -> the dtype it has at `amp`
    # Ids of tensors made from weighted features: a weightless layer's output
    # on the model's inputs (a Flatten's, a Rescaling's) is still raw.
    derived = set()
    accounts = {}
    first = float8.first_layers(model)
    for call in calls:
        layer = call.layer
        dtype = compute.get(id(layer), "float32")
        entry = accounts.setdefault(id(layer), Account(layer, dtype, reasons.get(id(layer), "")))
        work = speed_trace.work(call)
        from_features = any(t in derived for _, _, t in call.inputs)
        raw = id(layer) in first and not from_features
        if from_features or float8.weighs_inputs(layer):
            derived.update(t for _, _, t in call.outputs)
        entry.flops += work.flops
        entry.step_flops += (2 if raw else 3) * work.flops
        entry.dims = list(work.dims)
        fp8 = is_float8(policies.get(id(layer)))
        if id(layer) in policies:
            entry.variables = keras.backend.standardize_dtype(policies[id(layer)].variable_dtype)
        if fp8:
            entry.matmul = "float8"
        # A tensor no layer returned was made by its caller's own arithmetic
        # (or is a model input: float32).
        context = _caller_dtype(layer, parents, compute, amp, model) or "float32"
        # An FP8 matmul reads its operands in one byte each.
        read = 1 if fp8 else nbytes(dtype)
        for shape, _, tensor in call.inputs:
            size = numel(shape)
            source = produced.get(tensor, context)
            entry.moved += 3 * size * read
            if source != dtype:
                entry.casts += 2  # forward, and the gradient's back
                entry.cast_bytes += 2 * size * (nbytes(source) + nbytes(dtype))
                entry.cast_values += 2 * size
        # Its weights: read forward and backward, a gradient written; where
        # they are kept in another dtype (O1/O2's float32), cast both ways.
        policy = policies.get(id(layer), layer.dtype_policy)
        for variable in keras_internals.own_trainable_variables(layer):
            size = numel(variable.shape)
            entry.moved += 3 * size * read
            kept_in = variable_dtype(layer, variable, policy)
            if keras.backend.is_float_dtype(kept_in) and kept_in != dtype:
                entry.casts += 2
                entry.cast_bytes += 2 * size * (nbytes(kept_in) + nbytes(dtype))
                entry.cast_values += 2 * size
                if len(variable.shape) >= 2:
                    # A kernel's cast is an operand of its matmul: kept
                    # for the backward pass.
                    entry.kept += size * nbytes(dtype)
        if fp8:
            # Quantized to FP8 (read in `dtype`, written in one byte): its
            # inputs and kernel forward, its output's gradient backward.
            quantized = sum(numel(shape) for shape, _, _ in call.inputs + call.outputs)
            quantized += numel(float8.gemm_dims(layer).values())
            entry.casts += 3
            entry.cast_bytes += quantized * (nbytes(dtype) + 1)
            entry.cast_values += quantized
        returned = _returned_dtype(layer, dtype, parents, compute, amp, model)
        if id(layer) in outputs:
            returned = "float32"
        for shape, _, tensor in call.outputs:
            size = numel(shape)
            entry.moved += 3 * size * nbytes(dtype)
            entry.kept += size * nbytes(dtype)
            entry.output_values += size
            produced[tensor] = returned
            if returned != dtype:
                entry.casts += 2
                entry.cast_bytes += 2 * size * (nbytes(dtype) + nbytes(returned))
                entry.cast_values += 2 * size
    return accounts


def _caller_dtype(layer, parents, compute, amp, model):
    """The dtype of the arithmetic of the layer that calls `layer`, when that
    layer runs its own `call`; None inside Sequential and functional models."""
    parent = parents.get(id(layer))
    if parent is None or layer_tree.is_graph(parent):
        return None
    if parent is model and layer_tree.is_subclassed(model):
        return amp.inner_dtype
    return compute.get(id(parent))


def _returned_dtype(layer, dtype, parents, compute, amp, model):
    """What a call returns to its caller: inside a layer that runs its own
    `call`, the caller's dtype (the boundary rule); else its own."""
    return _caller_dtype(layer, parents, compute, amp, model) or dtype


def numel(shape):
    size = 1
    for d in shape:
        size *= d
    return size


def variable_dtype(layer, variable, policy):
    """A variable's dtype under `policy`: the policy's variable dtype, unless
    it has a dtype of its own (integer counters, LoRA's float32)."""
    own = keras.backend.standardize_dtype(variable.dtype)
    if keras.backend.is_float_dtype(own) and own == keras.backend.standardize_dtype(
        layer.dtype_policy.variable_dtype
    ):
        return keras.backend.standardize_dtype(policy.variable_dtype)
    return own


def is_float8(policy):
    return getattr(policy, "quantization_mode", None) == "float8"


def layer_seconds(account, peaks, tf32):
    """A layer's roofline time: its matmul FLOPs (half ones at their peak,
    float32 ones at the rate measurements reached, `Peaks.o0_rate`, at O0
    and at the level alike) against the bytes it moves."""
    aligned = not speed_trace.misaligned(account.dims)
    dtype = account.matmul or account.dtype
    if dtype == "float32":
        rate = peaks.o0_rate(tf32)
    else:
        rate = peaks.bound_rate(dtype, tf32=tf32, aligned=aligned)
    return max(account.step_flops / rate, account.moved / peaks.bandwidth)
