"""Which layers make each of a model's outputs, and which loss reads each:
the heads the head rule asks about (`conditions.may_overflow_float16`).

Each output is walked back, through the calls that made it, to the first
layer with weights on each path (`float8.weighs_inputs`), the head whose
matmul makes it, or to a normalisation, which sets its output's range:
through layers without weights (`Reshape`, `Activation`) and Keras
operations (`ops.squeeze(dense(x))`), into nested models, and into a layer
with sublayers of its own (a user's `Head` holding a `Dense`, a
`TimeDistributed`), whose `call` is traced on KerasTensors so that the walk
goes on inside it. A subclassed model's outputs are found the same way, its
`call` traced on the shapes it was built on. The nodes a trace records on
the layers it calls are removed when it ends
(`keras_internals.symbolic_calls`): the model is left as it was.

`compile`'s loss is paired with the outputs as Keras pairs it
(`output_losses.kinds`). A model not built yet cannot be traced: its last
layer with weights is taken for its head (`float8.weighted_in_call_order`)
until it is built (`compile` before `fit`), when `policies.apply` decides
again (`Heads.deferred`, `when_built`).
"""

import contextlib
import dataclasses
import functools

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import float8
from keras_mp._src.precision import head_returns
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import output_losses
from keras_mp._src.precision.float8 import weighs_inputs
from keras_mp._src.precision.layer_kinds import bounded_activation
from keras_mp._src.precision.layer_kinds import is_normalization


@dataclasses.dataclass
class Heads:
    """The heads of a model's outputs.

    Attributes:
        layers: `{id(layer): (output, bounded)}`: each layer that makes an
            output, the output (a key of `losses`), and whether a bounded
            activation (softmax, sigmoid, tanh) at or after the layer on
            its path keeps the output in range.
        losses: `{output: (loss name, whether a cross-entropy)}` for the
            outputs a loss keras_mp can name reads.
        deferred: a model or layer whose outputs need a trace was not built.
        alone: `{id(layer): whether its outputs reach its caller's outputs
            alone}` for the layers a traced `call` called
            (`head_returns.flows_alone`).
    """

    layers: dict = dataclasses.field(default_factory=dict)
    losses: dict = dataclasses.field(default_factory=dict)
    deferred: bool = False
    alone: dict = dataclasses.field(default_factory=dict)

    def head(self, layer):
        """None for a layer that makes no output, else whether it is bounded."""
        return self.layers.get(id(layer), (None, None))[1]

    def loss(self, layer):
        """The `(loss name, cross-entropy)` of the output `layer` makes, or None."""
        output = self.layers.get(id(layer), (None, None))[0]
        return None if output is None else self.losses.get(output)


def find(model, loss):
    """The `Heads` of `model` under `compile`'s `loss`: the outputs of its
    call; for a subclassed model, also those of the models it holds (a
    GAN's generator, a VAE's encoder), from which a `train_step` of its own
    computes its losses: one loss reaches these too, a list or dict none."""
    heads = Heads()
    walk = _Walk(heads)
    with contextlib.ExitStack() as stack:
        outputs, consumed = walk.outputs_of(model, stack)
        if outputs is None:
            # Its call could not be traced: as many heads as `compile`'s
            # losses, its last layers with weights, each given the most
            # cautious of the losses (which reads which is not known).
            given = output_losses.several(loss)
            heads.losses[("output", 0)] = given[0] if given else None
            walk.guess(model, ("output", 0), False, heads=max(1, len(given)))
        else:
            flat = keras.tree.flatten(outputs)
            leaves = keras.tree.pack_sequence_as(outputs, list(range(len(flat))))
            # `compile` pairs a dict of losses with these (Functional's).
            names = getattr(model, "output_names", None)
            losses = output_losses.kinds(loss, leaves, names)
            for i, output in enumerate(flat):
                if i in losses:
                    heads.losses[("output", i)] = losses[i]
                # An output other layers also take in (a feature extractor's)
                # is a head where a loss reads it.
                elif consumed(output):
                    continue
                walk.back(output, ("output", i))
    if layer_tree.is_subclassed(model):
        for held in keras_internals.children(model):
            if layer_tree.is_container(held):
                heads.losses[("held", id(held))] = output_losses.kind(loss)
                walk.all_outputs(held, ("held", id(held)))
    return heads


def when_built(model, callback):
    """Calls `callback()` once, right after `model` is built (its first
    call, `fit`, `build`); a later call replaces an earlier callback. Keras
    gives each layer its `build` on the instance (`Layer.__new__` wraps the
    class's to record the shapes and set `built`); this wraps that one,
    keeping what Keras reads of it (its signature, whether it is the
    default `build`)."""
    pending = _WHEN_BUILT in model.__dict__
    object.__setattr__(model, _WHEN_BUILT, callback)
    if pending:
        return
    build = model.build

    @functools.wraps(build)
    def build_then_call_back(*args, **kwargs):
        build(*args, **kwargs)
        object.__setattr__(model, "build", build)
        model.__dict__.pop(_WHEN_BUILT)()

    object.__setattr__(model, "build", build_then_call_back)


_WHEN_BUILT = "_keras_mp_when_built"


def _trace(layer, arguments, stack):
    """`(outputs, consumed)` of `layer.call` traced on new KerasTensors like
    those of `arguments` (a call's `(args, kwargs)`; None: the shapes the
    layer was built on), the trace left open in `stack`; `(None, None)`
    where it cannot run. A call that reads its inputs' sizes in Python
    (`ops.arange(length)`, a causal mask) runs again with each unknown
    dimension 2."""
    for fill in (None, 2):
        attempt = contextlib.ExitStack()
        consumed = attempt.enter_context(keras_internals.symbolic_calls(layer))
        try:
            args, kwargs = _new_tensors(layer, arguments, fill)
            outputs = layer.call(*args, **kwargs)
        except Exception:  # noqa: BLE001 (a call the symbolic pass cannot run)
            attempt.close()
            continue
        stack.enter_context(attempt)
        return outputs, consumed
    return None, None


def _new_tensors(layer, arguments, fill):
    """`(args, kwargs)`: new KerasTensors (made by no call) of the shapes
    and dtypes of those in `arguments`, or of the shapes `layer` was built
    on, as Keras's own build by a symbolic call makes them (by the names of
    `build`'s arguments less `_shape`); an unknown dimension `fill` unless
    None."""

    def new(shape, dtype="float32"):
        return keras.KerasTensor(tuple(fill if d is None and fill else d for d in shape), dtype)

    if arguments is not None:
        return keras.tree.map_structure(
            lambda x: new(x.shape, x.dtype) if isinstance(x, keras.KerasTensor) else x, arguments
        )
    shapes = keras_internals.build_shapes(layer)
    if len(shapes) == 1:
        return (keras.tree.map_shape_structure(new, *shapes.values()),), {}
    return (), {name.removesuffix("_shape"): new(shape) for name, shape in shapes.items()}


def _bounds_its_outputs(layer):
    # A normalisation's output is its scale times a unit-variance tensor.
    return (
        bounded_activation(layer) is not None
        or isinstance(layer, keras.layers.Softmax)
        or is_normalization(layer)
    )


def _operation(output):
    made = keras_internals.made_by(output) if isinstance(output, keras.KerasTensor) else None
    return output if made is None else made[0]


class _Layers:
    """The output of a Sequential never built on an input: its layers,
    walked back from the last."""

    def __init__(self, layers):
        self.layers = layers


class _Walk:
    """Walks outputs back to their heads, noting them in `heads`."""

    def __init__(self, heads):
        self.heads = heads
        self.weighted = 0  # how many layers with weights were found

    def add(self, layer, output, bounded):
        bounded = bounded or _bounds_its_outputs(layer)
        self.heads.layers[id(layer)] = (output, bounded)
        self.weighted += weighs_inputs(layer)
        return bounded

    def outputs_of(self, model, stack):
        """`(outputs, consumed)`: the model's outputs as its call returns
        them, each a KerasTensor to walk back from (or `_Layers`), and
        whether other calls of the model also take an output in;
        `(None, None)` where its call cannot be traced. A trace stays open
        in `stack` while its outputs are walked."""
        if layer_tree.is_graph(model):
            outputs = keras_internals.graph_outputs(model)
            if outputs is None:
                return _Layers(model.layers), lambda output: False
            consumed = keras_internals.consumed_outputs(model)
            return outputs, lambda output: keras_internals.output_key(output) in consumed
        if not model.built:
            self.heads.deferred = True
            return None, None
        outputs, consumed = self._trace(model, None, stack)
        return outputs, consumed and (lambda output: consumed(_operation(output)))

    def _trace(self, layer, arguments, stack):
        """`_trace`, noting where the outputs of the layers it calls go."""
        outputs, consumed = _trace(layer, arguments, stack)
        if outputs is not None:
            self.heads.alone.update(head_returns.flows_alone(layer, outputs, consumed))
        return outputs, consumed

    def all_outputs(self, model, key, bounded=False):
        """Walks back from every output of `model` others of it do not take
        in; returns whether a path reached its inputs with no layer with
        weights on it."""
        with contextlib.ExitStack() as stack:
            outputs, consumed = self.outputs_of(model, stack)
            if outputs is None:
                return self.guess(model, key, bounded)
            flat = [o for o in keras.tree.flatten(outputs) if not consumed(o)]
            return any([self.back(output, key, bounded) for output in flat])

    def back(self, output, key, bounded=False):
        """Notes the heads of `output` (a KerasTensor, or `_Layers`);
        returns whether a path reached an input of the graph or trace it
        is in with no layer with weights on it."""
        if isinstance(output, _Layers):
            return self._back_in_order(output.layers, key, bounded)
        reached = False
        stack, seen = [(output, bounded)], set()
        while stack:
            tensor, bounded = stack.pop()
            made = keras_internals.made_by(tensor)
            if made is None or isinstance(made[0], keras.layers.InputLayer):
                reached = True
                continue
            operation, index, inputs, arguments = made
            if id(tensor) in seen or id(operation) in self.heads.layers:
                continue
            seen.add(id(tensor))
            if isinstance(operation, keras.layers.Layer):
                if not self._through(operation, index, arguments, key, bounded):
                    continue
                bounded = self.heads.layers.get(id(operation), (None, bounded))[1]
            stack.extend((t, bounded) for t in inputs)
        return reached

    def _through(self, layer, index, arguments, key, bounded):
        """Notes `layer` on an output's way back; returns whether the walk
        goes on before it (no layer with weights made its output `index`
        inside it; None: all its outputs)."""
        if not layer_tree.is_container(layer):
            bounded = self.add(layer, key, bounded)
            # A norm sets its output's range, whatever made its input (a
            # backbone's residual stream ends in one).
            if weighs_inputs(layer) or is_normalization(layer):
                return False
        if not layer_tree.has_sublayers(layer):
            return True
        if layer_tree.is_container(layer) and (index is None or layer_tree.is_graph(layer)):
            if index is None:
                return self.all_outputs(layer, key, bounded)
            outputs, _ = self.outputs_of(layer, None)
            return self.back(keras.tree.flatten(outputs)[index], key, bounded)
        if not layer.built:
            self.heads.deferred = True
            return self.guess(layer, key, bounded)
        with contextlib.ExitStack() as stack:
            outputs, _ = self._trace(layer, arguments, stack)
            if outputs is None:
                return self.guess(layer, key, bounded)
            flat = keras.tree.flatten(outputs)
            chosen = flat if index is None else flat[index : index + 1]
            weighted = self.weighted
            reached = any([self.back(output, key, bounded) for output in chosen])
        # None inside was called as a layer: its `call` runs its sublayers'
        # `call`s itself (`TimeDistributed`).
        return self.guess(layer, key, bounded) if reached and self.weighted == weighted else reached

    def _back_in_order(self, layers, key, bounded):
        """Back through a Sequential's layers, last first."""
        for layer in reversed(layers):
            if id(layer) in self.heads.layers:
                return False
            if not self._through(layer, None, None, key, bounded):
                return False
            bounded = self.heads.layers.get(id(layer), (None, bounded))[1]
        return True

    def guess(self, layer, key, bounded, heads=1):
        """Where a call cannot be traced: the last layer with weights it
        runs (`float8.weighted_in_call_order`; the last `heads` of them) is
        the head; with none, the walk goes on before it (returns True)."""
        last = float8.weighted_in_call_order(layer)[-heads:]
        for head in last:
            if id(head) not in self.heads.layers:
                self.add(head, key, bounded)
        return not last
