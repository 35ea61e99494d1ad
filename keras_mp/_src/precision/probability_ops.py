"""Keras's softmax, log_softmax and sigmoid in float32 where no layer holds
them: an operation of a functional graph, and a user's own `call`.

`probabilities.py` covers the layers (an activation, `Softmax`,
`Activation`); `keras.ops.softmax(x)`, `keras.ops.sigmoid(x)`,
`keras.ops.log_softmax(x)` and `keras.activations.*` (which call them) are
covered here, as torch.autocast covers `torch.softmax` wherever it is
called. Their half input is cast to float32 and the op computes there;
where the input is float32 already, nothing is added.

- In a functional graph each is an operation (`Softmax`, `LogSoftmax`,
  `Sigmoid`): its `call` is wrapped once, when the level is applied, and it
  returns what a float32 layer in its place would (`handoff.py`): the
  half dtype while every layer taking in its outputs computes in it and
  casts them (a softmax then keeping its half output for the backward
  pass, `probabilities.kept_in_half`), float32 otherwise.
- In a user's layer (its class defined outside Keras and KerasHub, a
  `Lambda`, a subclassed model) that computes in half, its own `call` runs
  in a frame (a thread-local stack, pushed by its boundary wrapper:
  `boundaries.py`): Keras's backend functions, wrapped once, compute in
  float32 while that frame is the innermost layer's (not inside a layer
  it calls: Keras's name-scope stack says), and return the dtype they
  were given, so the user's own arithmetic on them sees the dtype Keras's
  policy gives it (TensorFlow's raw ops do not promote); a softmax keeps
  its half output for the backward pass. The probabilities that such a
  layer returns as they are, where its outputs leave in float32 (a model's
  output, a subclassed model), are computed again in float32 and returned
  so, rather than their half rounding.

Until a user's layer computes in half under keras_mp, Keras's functions
are left as they are; after, they compute as Keras's in every other
layer, model and thread. Keras's and KerasHub's own layers are written for
Keras's mixed policies and keep theirs (a recurrent cell's gates: the
state it carries). Not reached: a backend's own function called directly
(`tf.nn.softmax`, `jax.nn.softmax`, `torch.softmax`).
"""

import functools
import threading

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision import handoff
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import probabilities
from keras_mp._src.precision.layer_kinds import runs_users_code

_HALF = ("float16", "bfloat16")
# On a user's layer: whether its own `call` computes these ops in float32.
_USERS_CODE_ATTRIBUTE = "_keras_mp_probability_ops"
# On a graph's operation: its name (`softmax`, ...) once its `call` is
# wrapped; and whether it computes in float32 now (its graph's level).
_WRAPPED_ATTRIBUTE = "_keras_mp_float32_op"
_ON_ATTRIBUTE = "_keras_mp_float32_op_on"
# The frames of users' layers whose `call` runs (this thread).
_FRAMES = threading.local()
_BACKEND_WRAPPED = []


def set_probability_ops(model, own_dtype):
    """For each layer in `model`'s tree (policies and casts set): a user's
    layer whose own code computes in half (`own_dtype(layer)`) computes
    these ops in float32 in its `call`; a graph's probability operations in
    float32 where their graph computes in half. Returns the users' layers
    that do (their `call` needs the frame: `boundaries.py`)."""
    marked = []
    for layer, _ in layer_tree.tree(model):
        if isinstance(layer, keras_internals.Functional):
            _set_graph_operations(layer)
        on = (
            keras.backend.standardize_dtype(own_dtype(layer)) in _HALF
            and runs_users_code(layer)
            and not layer_tree.is_graph(layer)
        )
        if on or getattr(layer, _USERS_CODE_ATTRIBUTE, False):
            object.__setattr__(layer, _USERS_CODE_ATTRIBUTE, on)
        if on:
            marked.append(layer)
    if marked:
        _wrap_backend_once()
    return marked


def in_users_code(layer):
    """Whether `layer`'s own `call` computes Keras's probability ops in float32."""
    return getattr(layer, _USERS_CODE_ATTRIBUTE, False)


def _in_half(layer):
    return keras.backend.standardize_dtype(layer.compute_dtype) in _HALF


# -- a functional graph's operations -------------------------------------------


def operations(graph):
    """`[(operation, its name, [its parents])]`: the probability operations
    of a functional model."""
    kinds = keras_internals.PROBABILITY_OPERATIONS
    return [
        (op, name, parents)
        for op, parents in keras_internals.operations_from_inputs(graph)
        for name, kind in kinds.items()
        if type(op) is kind
    ]


def computed_in_float32(op):
    """Whether a graph's operation computes in float32 (its name), or None."""
    return getattr(op, _WRAPPED_ATTRIBUTE, None) if getattr(op, _ON_ATTRIBUTE, False) else None


def rule_of_operation(op, name, graph):
    """What `precision_summary` says of a graph's probability operation."""
    rule = f"keras.ops.{name} in float32"
    handed = handoff.handoff_of(op)
    if handed is None:
        return f"{rule}; returns float32"
    rule = f"{rule}; returns {handed} to its {handed} consumers in {graph.name}"
    if _axis(name, getattr(op, "axis", None)) is not None:
        rule = f"{rule} (kept in {handed} for the backward pass)"
    return rule


# `precision_summary`'s line under its table, before the layers it names.
USERS_CODE_NOTE = (
    "Softmax, log_softmax and sigmoid of keras.ops and keras.activations compute in "
    "float32 (returned in the dtype they are given; float32 where returned as the "
    "model's output) in the calls of"
)


def _set_graph_operations(graph):
    found = operations(graph)
    if not found:
        return
    # Where the level computes anything in half (O1 keeps the graph itself
    # in float32, its allow-list in half).
    on = any(_in_half(layer) for layer in keras_internals.all_layers(graph))
    consumers, outputs = layer_tree.successors(graph)
    for op, name, _ in found:
        object.__setattr__(op, _ON_ATTRIBUTE, on)
        if not on:
            handoff.clear(op)
            continue
        if getattr(op, _WRAPPED_ATTRIBUTE, None) is None:
            object.__setattr__(op, "call", _in_float32(op, name, op.call))
            object.__setattr__(op, _WRAPPED_ATTRIBUTE, name)
        handed = handoff.half_consumers_of(op, consumers, outputs)
        if handed is None:
            handoff.clear(op)
        else:
            handoff.record(op, graph, *handed)


def _in_float32(op, name, call):
    @functools.wraps(call)
    def call_in_float32(x):
        if not getattr(op, _ON_ATTRIBUTE, False) or _dtype(x) not in _HALF:
            return call(x)
        handed = handoff.handed_dtype(op)
        if handed is None:
            return call(keras.ops.cast(x, "float32"))
        return _returned_in(handed, call, x, _axis(name, getattr(op, "axis", None)))

    return call_in_float32


# -- a user's own `call` ----------------------------------------------------------


class _Frame:
    """A user's layer's `call` running: the layers' name scopes open when it
    began (one more: a layer it calls runs), whether its outputs leave in
    float32, and the latest probabilities it computed."""

    __slots__ = ("scopes", "returns_float32", "last")

    def __init__(self, returns_float32):
        self.scopes = keras_internals.layer_scopes()
        self.returns_float32 = returns_float32
        self.last = None  # (half probabilities, their float32 computation)


def _frames():
    frames = getattr(_FRAMES, "stack", None)
    if frames is None:
        frames = _FRAMES.stack = []
    return frames


def own_call(call, returns_float32):
    """`call`, a user's layer's own, in its frame: the probabilities it
    returns as they are come back in float32 where `returns_float32`."""

    @functools.wraps(call)
    def call_in_frame(*args, **kwargs):
        frames = _frames()
        frame = _Frame(returns_float32)
        frames.append(frame)
        try:
            outputs = call(*args, **kwargs)
        finally:
            frames.pop()
        if frame.last is None:
            return outputs
        half, in_float32 = frame.last
        return keras.tree.map_structure(lambda t: in_float32() if t is half else t, outputs)

    return call_in_frame


def _own_frame():
    """The frame of the user's layer whose own code runs now, or None
    (none runs, or a layer it calls does)."""
    frames = getattr(_FRAMES, "stack", None)
    if not frames:
        return None
    frame = frames[-1]
    if keras_internals.layer_scopes() > frame.scopes:
        return None
    return frame


def _wrap_backend_once():
    if _BACKEND_WRAPPED:
        return
    nn = keras_internals.backend_nn
    for name in keras_internals.PROBABILITY_OPERATIONS:
        setattr(nn, name, _in_float32_in_users_code(name, getattr(nn, name)))
    _BACKEND_WRAPPED.append(True)


def _in_float32_in_users_code(name, function):
    @functools.wraps(function)
    def probability(x, *args, **kwargs):
        frame = _own_frame()
        if frame is None or _dtype(x) not in _HALF:
            return function(x, *args, **kwargs)

        def call(v):
            return function(v, *args, **kwargs)

        axis = _axis(name, kwargs.get("axis", args[0] if args else -1))
        y = _returned_in(_dtype(x), call, x, axis)
        if frame.returns_float32:
            frame.last = (y, lambda: call(keras.ops.cast(x, "float32")))
        return y

    return probability


# -- both ----------------------------------------------------------------------------


def _returned_in(dtype, call, x, axis):
    """`call` on half `x` cast to float32, returned in the half `dtype`; a
    softmax (over `axis`, None for another op) in training keeps its half
    output for the backward pass."""

    def in_float32(v):
        return call(keras.ops.cast(v, "float32"))

    if axis is not None and keras_internals.call_in_training():
        gradient = probabilities.softmax_gradient(axis)
        return backends.current.saved_in_half(in_float32, gradient, x, dtype)
    return keras.ops.cast(in_float32(x), dtype)


def _axis(name, axis):
    """A softmax's axis as its gradient takes it; None for the others (their
    half output would lose digits: `probabilities._gradient`) and for a
    softmax over every axis."""
    if name != "softmax" or axis is None:
        return None
    return tuple(axis) if isinstance(axis, (tuple, list)) else axis


def _dtype(x):
    dtype = getattr(x, "dtype", None)
    return None if dtype is None else keras.backend.standardize_dtype(dtype)
