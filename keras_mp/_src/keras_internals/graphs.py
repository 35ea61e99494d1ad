"""Keras's graphs: a functional model's operations and the tensors they
make, and symbolic passes over a `call` (the head rule's and the speed
report's traces)."""

import contextlib
import importlib

import keras

from keras_mp._src.keras_internals.layers import all_layers
from keras_mp._src.keras_internals.required import _need

# Sequential and functional models: Keras casts each of their layers' inputs.
Functional = _need("keras.src.models.functional", "Functional")

# The speed report: a symbolic forward pass, and the convolutions' bases.
_compute_output_spec = _need("keras.src.backend", "compute_output_spec")

_global_state = importlib.import_module("keras.src.backend.common.global_state")


def compute_output_spec(fn, *args, **kwargs):
    """Keras's symbolic pass, leaving Keras's name-scope stack as it found
    it. On TensorFlow the pass runs in a new graph, where a model whose name
    TensorFlow refuses as a root scope (`_MyModel` names itself
    `__my_model`) raises inside Keras's `name_scope.__enter__` after its
    entry was pushed: every variable made later in the process would be
    named under it. The pass runs `fn` under a scope of its own, so that
    the model's is never a root scope and the pass goes through."""

    def scoped(*args, **kwargs):
        with keras.name_scope("keras_mp_pass"):
            return fn(*args, **kwargs)

    stack = _global_state.get_global_attribute("name_scope_stack")
    depth = len(stack) if stack else 0
    try:
        return _compute_output_spec(scoped, *args, **kwargs)
    finally:
        stack = _global_state.get_global_attribute("name_scope_stack")
        if stack and len(stack) > depth:
            del stack[depth:]


# Keras's probability operations, as a functional graph holds them
# (`ops.softmax`, `ops.log_softmax`, `ops.sigmoid`, and `keras.activations.*`
# on a Keras tensor), by the name of the function that makes them.
PROBABILITY_OPERATIONS = {
    "softmax": _need("keras.src.ops.nn", "Softmax"),
    "log_softmax": _need("keras.src.ops.nn", "LogSoftmax"),
    "sigmoid": _need("keras.src.ops.nn", "Sigmoid"),
}


def output_operations(model):
    """The operations (layers) that make a functional model's outputs; empty
    for a model that has none known (subclassed)."""
    return [t._keras_history.operation for t in output_tensors(model)]


def consumed_outputs(model):
    """Keys (`output_key`) of the tensors of a functional model that another
    of its operations takes in (an intermediate output of a feature
    extractor). Per tensor, not per layer: a tied embedding called twice
    makes one tensor another layer takes in (its lookup) and one that no
    layer does (its logits, the model's output)."""
    consumed = set()
    for nodes in (getattr(model, "_nodes_by_depth", None) or {}).values():
        for node in nodes:
            consumed.update(output_key(t) for t in node.input_tensors)
    consumed.discard(None)
    return consumed


def output_key(tensor):
    """`(id of the operation, its call, which output)` of a Keras tensor a
    layer or op made, or None."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    return id(history.operation), history.node_index, history.tensor_index


def output_tensors(model):
    """The Keras tensors a functional model returns, each made by one of its
    operations; empty for a model that has none known (subclassed)."""
    outputs = getattr(model, "_outputs", None) or ()
    return [t for t in keras.tree.flatten(outputs) if output_key(t) is not None]


def graph_outputs(model):
    """A Sequential or functional model's output KerasTensors as its call
    returns them (a dict keeps its keys, a list of one is its tensor), or
    None (a Sequential never built on an input has no graph)."""
    if isinstance(model, keras.Sequential):
        model = getattr(model, "_functional", None)
    outputs = getattr(model, "_outputs_struct", None)
    single = isinstance(outputs, (list, tuple)) and len(outputs) == 1
    return outputs[0] if single else outputs  # as Keras's `unpack_singleton`


def graph_inputs(model):
    """A Sequential or functional model's input KerasTensors as its call
    takes them, or None (a Sequential never built on an input)."""
    if isinstance(model, keras.Sequential):
        model = getattr(model, "_functional", None)
    return getattr(model, "_inputs_struct", None)


def made_by(tensor):
    """`(operation, output index, inputs, (args, kwargs))` of the call that
    made a KerasTensor, or None (a graph's input)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    node = history.operation._inbound_nodes[history.node_index]
    call = (tuple(node.arguments.args), node.arguments.kwargs)
    return history.operation, history.tensor_index, node.input_tensors, call


@contextlib.contextmanager
def symbolic_calls(layer):
    """A scope for calling `layer`'s `call` on KerasTensors: each layer and
    Keras operation called inside records a node (`made_by` reads them). On
    exit those recorded on `layer` and the layers in it are removed: the
    functional API reads them (`layer.output`, a graph's node indices).
    Yields `consumed(operation)`: how many times calls inside took in its
    outputs (a call taking two of them: twice; 0 for none).
    Outside any name scope, it opens one of its own, as `compute_output_spec`
    does; inside a model's (its build), a layer it builds is named as the
    model's own call would name it."""
    counts = {
        id(each): (each, len(each._inbound_nodes), len(each._outbound_nodes))
        for each in all_layers(layer)
    }

    def consumed(operation):
        outbound = getattr(operation, "_outbound_nodes", ())  # not an operation: an input
        return len(outbound) - counts.get(id(operation), (0, 0, 0))[2]

    stack = _global_state.get_global_attribute("name_scope_stack")
    depth = len(stack) if stack else 0
    try:
        with keras.name_scope("keras_mp_pass") if depth == 0 else contextlib.nullcontext():
            yield consumed
    finally:
        for each, inbound, outbound in counts.values():
            del each._inbound_nodes[inbound:]
            del each._outbound_nodes[outbound:]
        stack = _global_state.get_global_attribute("name_scope_stack")
        if stack and len(stack) > depth:
            del stack[depth:]


def operations_from_inputs(model):
    """A functional model's operations from its inputs on, each with the
    operations whose outputs it takes in: `[(operation, [parents])]`, every
    operation after its parents (an input layer has none)."""
    found = []
    by_depth = getattr(model, "_nodes_by_depth", None) or {}
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            found.append((node.operation, [p.operation for p in node.parent_nodes]))
    return found
