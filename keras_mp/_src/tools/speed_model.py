"""The speed report's model of a step: per layer, at a level, its work,
casts and bytes (`account`), the step's memory (`memory`), and its time on
a GPU as a roofline per layer (`step_seconds`). `speed_report.py` turns
them into the table, the bound and the advice."""

import dataclasses

import keras

from keras_mp._src import keras_internals
from keras_mp._src.optimizer import low_precision_state
from keras_mp._src.precision import float8
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.levels import HALF_DTYPES
from keras_mp._src.precision.policies import decide_all
from keras_mp._src.tools import speed_trace

_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _bytes(dtype):
    return _BYTES.get(keras.backend.standardize_dtype(dtype), 4)


@dataclasses.dataclass
class Account:
    """A layer's share of the step at one precision."""

    layer: object
    dtype: str
    reason: str = ""
    matmul: str = ""  # the dtype of its matmul where not `dtype` ("float8")
    flops: int = 0
    dims: list = dataclasses.field(default_factory=list)
    casts: int = 0
    cast_bytes: int = 0
    moved: int = 0  # bytes its calls read and write, forward and backward
    kept: int = 0  # bytes of its outputs (and kernels' casts) kept for the backward pass
    # Matmuls a step per forward one: the forward, its weights' gradient and
    # its inputs' gradient; a first layer's inputs (the model's, which train
    # nothing) get no gradient, so 2 there.
    passes: int = 3

    @property
    def step_flops(self):
        """Its matmul FLOPs in a train step, forward and backward."""
        return self.passes * self.flops


def slots_of(model):
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.SGD):
        return 1 if inner.momentum else 0
    return 2  # Adam, AdamW and most others


def moments_of(model):
    """The model's optimizer's `moment_dtypes` (None: float32 slots)."""
    return getattr(getattr(model, "optimizer", None), "moment_dtypes", None)


def accounts_at(model, calls, amp):
    """Per layer (in the order they first ran): work, casts and bytes at `amp`."""
    compute, reasons, policies = {}, {}, {}
    for layer, (policy_name, reason) in decide_all(model, amp):
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
    accounts = {}
    first = float8.first_layers(model)
    for call in calls:
        layer = call.layer
        dtype = compute.get(id(layer), "float32")
        entry = accounts.setdefault(id(layer), Account(layer, dtype, reasons.get(id(layer), "")))
        entry.passes = 2 if id(layer) in first else 3
        work = speed_trace.work(call)
        entry.flops += work.flops
        entry.dims = list(work.dims)
        fp8 = _is_float8(policies.get(id(layer)))
        if fp8:
            entry.matmul = "float8"
        # A tensor no layer returned was made by its caller's own arithmetic
        # (or is a model input: float32).
        context = _caller_dtype(layer, parents, compute, amp, model) or "float32"
        # An FP8 matmul reads its operands in one byte each.
        read = 1 if fp8 else _bytes(dtype)
        for shape, _, tensor in call.inputs:
            size = numel(shape)
            source = produced.get(tensor, context)
            entry.moved += 3 * size * read
            if source != dtype:
                entry.casts += 2  # forward, and the gradient's back
                entry.cast_bytes += 2 * size * (_bytes(source) + _bytes(dtype))
        # Its weights: read forward and backward, a gradient written; where
        # they are kept in another dtype (O1/O2's float32), cast both ways.
        policy = policies.get(id(layer), layer.dtype_policy)
        for variable in keras_internals.own_trainable_variables(layer):
            size = numel(variable.shape)
            entry.moved += 3 * size * read
            kept_in = _variable_dtype(layer, variable, policy)
            if keras.backend.is_float_dtype(kept_in) and kept_in != dtype:
                entry.casts += 2
                entry.cast_bytes += 2 * size * (_bytes(kept_in) + _bytes(dtype))
                if len(variable.shape) >= 2:
                    # A kernel's cast is an operand of its matmul: kept
                    # for the backward pass.
                    entry.kept += size * _bytes(dtype)
        if fp8:
            # Quantized to FP8 (read in `dtype`, written in one byte): its
            # inputs and kernel forward, its output's gradient backward.
            quantized = sum(numel(shape) for shape, _, _ in call.inputs + call.outputs)
            quantized += numel(float8.gemm_dims(layer).values())
            entry.casts += 3
            entry.cast_bytes += quantized * (_bytes(dtype) + 1)
        returned = _returned_dtype(layer, dtype, parents, compute, amp, model)
        if id(layer) in outputs:
            returned = "float32"
        for shape, _, tensor in call.outputs:
            size = numel(shape)
            entry.moved += 3 * size * _bytes(dtype)
            entry.kept += size * _bytes(dtype)
            produced[tensor] = returned
            if returned != dtype:
                entry.casts += 2
                entry.cast_bytes += 2 * size * (_bytes(dtype) + _bytes(returned))
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


def _variable_dtype(layer, variable, policy):
    """A variable's dtype under `policy`: the policy's variable dtype, unless
    it has a dtype of its own (integer counters, LoRA's float32)."""
    own = keras.backend.standardize_dtype(variable.dtype)
    if keras.backend.is_float_dtype(own) and own == keras.backend.standardize_dtype(
        layer.dtype_policy.variable_dtype
    ):
        return keras.backend.standardize_dtype(policy.variable_dtype)
    return own


def _is_float8(policy):
    return getattr(policy, "quantization_mode", None) == "float8"


def _float8_state(layer, policy):
    """The shapes of the scales and amax histories that Keras's float8
    policy adds to a layer not quantized yet (float32 each)."""
    if not _is_float8(policy) or _is_float8(layer.dtype_policy):
        return []
    return [()] * 3 + [(policy.amax_history_length,)] * 3


def memory(model, amp, slots, replicas, shard, accounts, moment_dtypes=None):
    """Bytes of weights, optimizer state and kept activations at `amp`
    (`moment_dtypes`: Adam's moments in low precision, their scales aside)."""
    per_weight = low_precision_state.bytes_per_weight(moment_dtypes, slots)
    weights = optimizer = 0
    for layer, (policy_name, _) in decide_all(model, amp):
        policy = keras.dtype_policies.get(policy_name) if policy_name else layer.dtype_policy
        # Keras's optimizers keep no slots for them (their gradient is
        # their new value).
        weights += sum(numel(shape) * 4 for shape in _float8_state(layer, policy))
        for variable in keras_internals.own_variables(layer):
            dtype = _variable_dtype(layer, variable, policy)
            size = numel(variable.shape)
            weights += size * _bytes(dtype)
            if not variable.trainable or getattr(variable, "overwrite_with_gradient", False):
                continue
            state = per_weight * size  # float32 slots (master copies' at O3) unless low
            if dtype in HALF_DTYPES:
                state += size * 4  # the float32 master copy
            optimizer += state / replicas if shard else state
    return {
        "weights": weights,
        "optimizer": int(optimizer),
        "activations": sum(a.kept for a in accounts.values()),
    }


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


def step_seconds(accounts, bytes_, peaks, tf32):
    layers = sum(layer_seconds(a, peaks, tf32) for a in accounts.values())
    casts = sum(a.cast_bytes for a in accounts.values()) / peaks.bandwidth
    # The update reads and writes weights and state, and reads the gradients.
    update = (3 * bytes_["weights"] + 2 * bytes_["optimizer"]) / peaks.bandwidth
    return layers + casts + update
