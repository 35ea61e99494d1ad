"""A language model's head, and the model up to it (its trunk), for the
chunked loss (`lm_loss.py`).

The head is the layer that makes a Sequential or functional model's one
output: a linear `Dense`, or a `ReversibleEmbedding` called with
`reverse=True` (KerasHub's `CausalLM`s: GPT-2, Gemma, Llama). The trunk is
a functional model from the model's inputs to the tensor the head takes
in, sharing every layer: `fit`'s step runs it in place of the model, and
the loss takes the hidden states it returns through the head chunk by
chunk. A subclassed model's head input cannot be read from a graph: it
keeps the plain loss, said.
"""

import dataclasses
import weakref

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import lm_loss


@dataclasses.dataclass(frozen=True)
class Found:
    """A model's head (`layer`), its trunk and whether the head passes its
    input's Keras mask on to the logits (a `Dense`; a `ReversibleEmbedding`
    sets none); or, where there is none, `why` (a phrase)."""

    layer: object = None
    trunk: object = None
    passes_mask: bool = False
    why: str = None


_FOUND = weakref.WeakKeyDictionary()


def find(model):
    """The model's `Found`, made once per built model (`forget` after a
    compile)."""
    found = _FOUND.get(model)
    if found is None:
        found = _find(model)
        if model.built:
            _FOUND[model] = found
    return found


def forget(model):
    _FOUND.pop(model, None)


def _find(model):
    if not layer_tree.is_graph(model):
        return Found(why="a subclassed model: the input of its head cannot be read from a graph")
    outputs = keras_internals.graph_outputs(model)
    if outputs is None:
        return Found(why="a Sequential model not built on an input yet")
    flat = keras.tree.flatten(outputs)
    if len(flat) != 1:
        return Found(why=f"{len(flat)} outputs (the chunked loss takes a model of one)")
    made = keras_internals.made_by(flat[0])
    layer = None if made is None else made[0]
    if made is None or not isinstance(layer, keras.layers.Layer):
        return Found(why="its output is not made by a layer")
    _, index, _, (args, kwargs) = made
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    reversed_embedding = isinstance(layer, keras.layers.ReversibleEmbedding)
    if (reversed_embedding and not reverse) or lm_loss.head_spec(layer) is None:
        return Found(
            why=f"its output layer `{layer.name}` ({type(layer).__name__}) is not a linear "
            "Dense or a ReversibleEmbedding read in reverse"
        )
    hidden = args[0] if args else None
    if not isinstance(hidden, keras.KerasTensor) or index != 0:
        return Found(why=f"the input of its head `{layer.name}` is not one tensor")
    inputs = keras_internals.graph_inputs(model)
    if inputs is None:
        return Found(why="a Sequential model not built on an input yet")
    try:
        trunk = keras.Model(inputs, hidden, name=f"{model.name}_trunk")
    except (ValueError, TypeError) as error:  # a graph Keras cannot cut there
        return Found(why=f"no model up to its head `{layer.name}` ({error})")
    return Found(layer, trunk, passes_mask=not reversed_embedding)
