"""Half between a float32 layer and its half consumers, while its model runs.

Inside a Sequential or functional model Keras casts each layer's inputs to
its compute dtype: a float32 layer (a normalisation of O2's deny-list)
whose every consumer computes in one half dtype and casts its inputs would
have its float32 outputs rounded to half on their way in. While that model
runs it, it returns the half dtype itself (`boundaries.py`'s wrapper asks
`handed_dtype`), so only half is held between them. Its calls from
anywhere else (a feature extractor built on its nodes, another model, a
layer's own `call`, a direct call) return what it computes.
"""

import functools
import threading
import weakref

import keras

from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import DATA_MOVEMENT

_HALF = ("float16", "bfloat16")
# A float32 layer of a graph -> `(graph, dtype, consumers, structure)`, kept
# beside the layer, not on it (weak references): Keras's saving walks a
# layer's attributes, and would save the consumers' weights under it.
_HANDOFFS = weakref.WeakKeyDictionary()
_MARKS_RUNS_ATTRIBUTE = "_keras_mp_marks_runs"
# The graphs (Sequential, functional models) running their `call` (this thread).
_GRAPH_RUNS = threading.local()


def record(layer, graph, dtype, consumers):
    """Makes `layer` return `dtype` while `graph` runs it, as long as each of
    `consumers` (the layers that take in its outputs there) computes in
    `dtype` and `graph` still holds them."""
    mark_runs(graph)
    _HANDOFFS[layer] = (
        weakref.ref(graph),
        dtype,
        tuple(weakref.ref(c) for c in consumers),
        _structure(graph),
    )


def clear(layer):
    _HANDOFFS.pop(layer, None)


def handoff_of(layer):
    """The half dtype `layer` hands its consumers, or None."""
    found = _HANDOFFS.get(layer)
    return None if found is None else found[1]


def _structure(graph):
    """What a Sequential model holds now (`pop` and `add` change it); a
    functional model's graph is fixed when it is made."""
    return tuple(id(layer) for layer in graph.layers) if isinstance(graph, keras.Sequential) else ()


def mark_runs(graph):
    """`graph`'s `call` notes, while it runs, that it is the innermost graph
    running (this thread)."""
    if getattr(graph, _MARKS_RUNS_ATTRIBUTE, False):
        return
    call = graph.call

    @functools.wraps(call)
    def call_marking_its_run(*args, **kwargs):
        stack = _running_graphs()
        stack.append(id(graph))
        try:
            return call(*args, **kwargs)
        finally:
            stack.pop()

    object.__setattr__(graph, "call", call_marking_its_run)
    object.__setattr__(graph, _MARKS_RUNS_ATTRIBUTE, True)


def _running_graphs():
    stack = getattr(_GRAPH_RUNS, "stack", None)
    if stack is None:
        stack = _GRAPH_RUNS.stack = []
    return stack


def handed_dtype(layer):
    """The dtype a hand-off gives this call, or None."""
    handoff = _HANDOFFS.get(layer)
    if handoff is None:
        return None
    graph, dtype, consumers, structure = handoff
    graph = graph()
    stack = _running_graphs()
    if graph is None or not stack or stack[-1] != id(graph) or _structure(graph) != structure:
        return None
    for consumer in consumers:
        consumer = consumer()
        # Gone, or its policy changed since (`to_float`).
        if consumer is None or keras.backend.standardize_dtype(consumer.compute_dtype) != dtype:
            return None
    return dtype


def half_for_consumers(layer, consumers, outputs):
    """`(dtype, consumers)`: the half dtype a float32 layer of a Sequential
    or functional model hands on, the one every layer that takes in its
    outputs there computes in and casts them to on its way in (through
    layers that only move values), and those layers; None where one of
    them is the model's output, computes in float32, keeps its inputs'
    dtype (Keras's `Embedding` family), is a nested model, or is not a
    layer (`x + 1` on a Keras tensor)."""
    if keras.backend.standardize_dtype(layer.compute_dtype) != "float32":
        return None
    # Whatever it computes, its consumers would round it to their dtype in
    # this model's run (a LayerNormalization that casts its own inputs, a
    # count): the hand-off holds in that run only.
    if layer_tree.is_container(layer) or isinstance(layer, DATA_MOVEMENT):
        return None
    return half_consumers_of(layer, consumers, outputs)


def half_consumers_of(operation, consumers, outputs):
    """`half_for_consumers` of any operation of a functional model (a
    float32 layer, or one of Keras's operations computing in float32:
    `probability_ops.py`), as far as its consumers go."""
    found, taking, stack, seen = set(), [], [operation], set()
    while stack:
        op = stack.pop()
        if any(op is o for o in outputs) or id(op) in seen:
            return None
        seen.add(id(op))
        taken_by = consumers.get(id(op), ())
        if not taken_by:
            return None
        for consumer in taken_by:
            if isinstance(consumer, DATA_MOVEMENT):
                stack.append(consumer)
                continue
            if (
                not isinstance(consumer, keras.layers.Layer)
                or layer_tree.is_container(consumer)
                or not consumer.autocast
                or not getattr(consumer, "_convert_input_args", True)
            ):
                return None
            found.add(keras.backend.standardize_dtype(consumer.compute_dtype))
            taking.append(consumer)
    if len(found) != 1 or not found <= set(_HALF):
        return None
    return found.pop(), taking
