"""Walks of a model's layer tree: who calls whom, in what order, and which
layers' outputs are the model's outputs."""

import keras

from keras_mp._src import keras_internals


def is_graph(layer):
    """Sequential and functional models: Keras casts each layer's inputs."""
    return isinstance(layer, (keras.Sequential, keras_internals.Functional))


def is_subclassed(model):
    """A model whose forward pass is its own `call`."""
    return isinstance(model, keras.Model) and not is_graph(model)


def is_container(layer):
    """A model inside the tree (it computes nothing itself)."""
    return isinstance(layer, keras.Model)


def has_sublayers(layer):
    return bool(keras_internals.children(layer))


def tree(model):
    """(layer, parent) for `model` and every layer inside it, parents first.

    The parent is the layer that tracks it (whose `call` calls it); a layer
    tracked by several is listed once, under the first.
    """
    seen = set()
    order = []
    stack = [(model, None)]
    while stack:
        layer, parent = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        order.append((layer, parent))
        stack.extend((child, layer) for child in reversed(keras_internals.children(layer)))
    return order


def layers_in_order(model):
    """The model and its layers, each once, depth first in the order they
    were added (Keras's recursive `_flatten_layers` lists a nested model's
    layers last to first)."""
    return [layer for layer, _ in tree(model)]


def intermediate_outputs(model):
    """Whether a functional model returns an output other layers of it take
    in (a feature extractor), itself or through a nested model it returns:
    its outputs are then cast to float32 by the model rather than by the
    layers that make them."""
    if not isinstance(model, keras.Model) or isinstance(model, keras.Sequential):
        return False
    consumed = keras_internals.consumed_outputs(model)
    outputs = keras_internals.output_tensors(model)
    operations = keras_internals.output_operations(model)
    return any(keras_internals.output_key(t) in consumed for t in outputs) or any(
        is_graph(op) and intermediate_outputs(op) for op in operations if op is not model
    )


def output_layers(model):
    """Layers whose outputs are the model's outputs (and no other layer's
    inputs).

    Known for Sequential and functional models (recursively, when an output
    comes from a nested model). A subclassed model's outputs are whatever its
    `call` returns: the subclassed model itself is listed, and its outputs
    are cast to float32 (`boundaries.py`). So are the outputs of the
    models it holds (a GAN's generator and discriminator, a VAE's encoder
    and decoder, a distiller's student and teacher): a `train_step` or
    `compute_loss` of its own computes its losses from them, as from the
    model's own outputs.
    """
    if is_subclassed(model):
        outputs = [model]
        for child in keras_internals.children(model):
            if is_graph(child):
                outputs.extend(output_layers(child))
            elif is_subclassed(child):
                outputs.append(child)
        return tuple(outputs)
    if isinstance(model, keras.Sequential):
        operations = model.layers[-1:]
    elif isinstance(model, keras.Model):
        # An output that other layers of the model take in (a feature
        # extractor's, every layer an output) computes as its level says;
        # the model casts it to float32 on the way out (`boundaries.py`).
        consumed = keras_internals.consumed_outputs(model)
        operations = [
            keras_internals.made_by(t)[0]
            for t in keras_internals.output_tensors(model)
            if keras_internals.output_key(t) not in consumed
        ]
    else:
        return ()
    layers = []
    for operation in operations:
        if operation is model:
            continue
        if isinstance(operation, keras.Model):
            layers.extend(output_layers(operation))
        elif not isinstance(operation, keras.layers.Layer):
            layers.extend(layers_before(model, operation))
        else:
            layers.append(operation)
    return tuple(layers)


def layers_before(model, operation):
    """The layers whose outputs a Keras operation of a functional model
    takes in, walking back through other operations: an output made by
    `ops.squeeze(dense(x), -1)` or `dense(x) * 1e4` is that Dense's, as
    far as its range goes (a nested model stands for its output layers)."""
    parents = predecessors(model)
    found, seen, stack = [], set(), list(parents.get(id(operation), ()))
    while stack:
        op = stack.pop()
        if id(op) in seen or isinstance(op, keras.layers.InputLayer):
            continue
        seen.add(id(op))
        if isinstance(op, keras.Model):
            found.extend(output_layers(op))
        elif isinstance(op, keras.layers.Layer):
            found.append(op)
        else:
            stack.extend(parents.get(id(op), ()))
    return found


def predecessors(graph):
    """`{id(operation): [the operations whose outputs it takes in]}` in a
    Sequential or functional model."""
    if isinstance(graph, keras.Sequential):
        layers = graph.layers
        return {id(b): [a] for a, b in zip(layers, layers[1:])}
    return {id(op): parents for op, parents in keras_internals.operations_from_inputs(graph)}


def successors(graph):
    """`(consumers, outputs)` of a Sequential or functional model:
    `{id(operation): [the operations that take in its outputs]}` and its
    output operations."""
    if isinstance(graph, keras.Sequential):
        layers = graph.layers
        return {id(a): [b] for a, b in zip(layers, layers[1:])}, layers[-1:]
    consumers = {}
    for op, parents in keras_internals.operations_from_inputs(graph):
        for parent in parents:
            consumers.setdefault(id(parent), []).append(op)
    return consumers, list(keras_internals.output_operations(graph))


def call_order(model, shape):
    """The layers inside `model` in the order its `call` first runs them,
    on inputs of `shape` (traced symbolically: nothing computes), or None
    where the pass fails. Each layer's `call` is wrapped for the pass only."""
    order, hooked = [], []
    for layer in layers_in_order(model)[1:]:
        if not hasattr(layer, "call"):
            continue
        own = layer.__dict__.get("call")

        def noting(*args, _layer=layer, _call=layer.call, **kwargs):
            if not any(_layer is seen for seen in order):
                order.append(_layer)
            return _call(*args, **kwargs)

        hooked.append((layer, own))
        object.__setattr__(layer, "call", noting)
    try:
        keras_internals.compute_output_spec(model, keras.KerasTensor(tuple(shape), "float32"))
    except Exception:  # noqa: BLE001 (a call the symbolic pass cannot run)
        return None
    finally:
        for layer, own in hooked:
            if own is None:
                layer.__dict__.pop("call", None)
            else:
                object.__setattr__(layer, "call", own)
    return order
