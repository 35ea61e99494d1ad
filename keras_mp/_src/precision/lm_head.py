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
from keras_mp._src.precision import boundaries
from keras_mp._src.precision import layer_tree


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
    if (reversed_embedding and not reverse) or head_spec(layer) is None:
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


# -- what the loss needs to know of a head ---------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenHead:
    """What the loss needs to know of a head beside its weights.

    Attributes:
        transposed: the kernel is `[vocabulary, hidden]` (an embedding's
            table, read in reverse), else `[hidden, vocabulary]` (a Dense).
        compute_dtype: the dtype of the head's matmul.
        input_dtype: the dtype the hidden states are rounded to first, where
            not `compute_dtype` (a half head reading its float32 table as
            stored: `boundaries.reads_weights_in_float32`); "" otherwise.
        soft_cap: `tanh(z / cap) * cap` after the matmul, or None.
        bias: whether the weights end with a bias.
    """

    transposed: bool
    compute_dtype: str
    soft_cap: object = None
    bias: bool = False
    input_dtype: str = ""

    def vocabulary(self, kernel):
        return kernel.shape[0] if self.transposed else kernel.shape[1]


def head_spec(layer):
    """The `TokenHead` of a head layer (a linear `Dense`, or a
    `ReversibleEmbedding` read in reverse), or None for any other layer or
    one whose matmul is not its plain kernel (quantized). Reads no weight
    (a LoRA kernel is a matmul of variables a JAX step may hold no value
    in)."""
    if getattr(layer, "quantization_mode", None):
        return None
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    if isinstance(layer, keras.layers.Dense):
        if layer.activation not in (None, keras.activations.linear):
            return None
        return TokenHead(False, compute, None, layer.use_bias)
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        # `reverse_dtype`: the hidden states and the table (tied or not)
        # cast to it before the reverse matmul.
        reverse = keras.backend.standardize_dtype(layer.reverse_dtype or compute)
        half = boundaries.reads_weights_in_float32(layer)
        if half is not None:
            # Its half inputs times its float32 table, as the head computes
            # them on this device (`cpu_rates.tables_in_half`).
            return TokenHead(layer.tie_weights, "float32", layer.logit_soft_cap, input_dtype=half)
        return TokenHead(layer.tie_weights, reverse, layer.logit_soft_cap)
    return None


def vocabulary_of(layer):
    """A head layer's vocabulary, from its configuration (no weight read)."""
    return layer.units if isinstance(layer, keras.layers.Dense) else layer.input_dim


def head_of(layer):
    """`(TokenHead, weights)` of a head layer (`head_spec`), its weights as
    its matmul reads them (a LoRA kernel with its update), or None."""
    head = head_spec(layer)
    if head is None:
        return None
    if isinstance(layer, keras.layers.Dense):
        return head, (layer.kernel,) + ((layer.bias,) if layer.use_bias else ())
    return head, ((layer.embeddings,) if layer.tie_weights else (layer.reverse_embeddings,))
