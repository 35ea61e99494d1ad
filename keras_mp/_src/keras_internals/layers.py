"""Layers from inside: their sublayers, masks and call context, the state
they created, the dtype machinery and the backend functions they call."""

import keras

from keras_mp._src.keras_internals.required import _need

get_keras_mask = _need("keras.src.backend", "get_keras_mask")

set_keras_mask = _need("keras.src.backend", "set_keras_mask")

# Reads a layer's float32 weights and inputs in another dtype (`fallback.py`).
AutocastScope = _need("keras.src.backend", "AutocastScope")

BaseConv = _need("keras.src.layers.convolutional.base_conv", "BaseConv")

BaseConvTranspose = _need("keras.src.layers.convolutional.base_conv_transpose", "BaseConvTranspose")

BaseDepthwiseConv = _need("keras.src.layers.convolutional.base_depthwise_conv", "BaseDepthwiseConv")

BaseSeparableConv = _need("keras.src.layers.convolutional.base_separable_conv", "BaseSeparableConv")

no_automatic_dependency_tracking = _need(
    "keras.src.utils.tracking", "no_automatic_dependency_tracking"
)


def stateless_scope():
    """The active `keras.StatelessScope`, or None."""
    return _need("keras.src.backend.common.stateless_scope", "get_stateless_scope")()


_global_state = _need("keras.src.backend.common", "global_state")


def call_in_training():
    """Whether the layer call under way runs in training (Keras's call
    context, set by the outermost layer called); False outside a call."""
    context = _global_state.get_global_attribute("current_call_ctx")
    return bool(getattr(context, "training", None))


# The backend's module of those functions: every Keras road to them (`ops`,
# `activations`, a graph's operations, the layers) calls them through it.
backend_nn = _need("keras.src", "backend").nn

# The current backend's NumPy-like ops (`matmul`, `einsum`): the speed
# report's trace notes the matmuls a layer's own `call` runs through them.
backend_numpy = _need("keras.src", "backend").numpy


def layer_scopes():
    """How many layers' name scopes are open (Keras's name-scope stack, this
    thread): each layer's `__call__` opens its own around its `call`."""
    stack = _global_state.get_global_attribute("name_scope_stack") or ()
    return sum(isinstance(getattr(s, "caller", None), keras.layers.Layer) for s in stack)


def children(layer):
    """The layers `layer` tracks directly (its sublayers, one level down)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def is_keras_layer_class(layer):
    """Whether `layer` is an instance of one of Keras's own layer classes
    (`Dense`, `BatchNormalization`; not a model, not a subclass of the
    user's), read from the module that defines its class."""
    return type(layer).__module__.startswith("keras.src.layers.")


def all_layers(layer):
    """`layer` and every layer inside it (Keras's own recursive walk)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def build_shapes(layer):
    """The shapes a layer was built on, by the names of `build`'s arguments."""
    return dict(getattr(layer, "_build_shapes_dict", None) or {})


def built_input_shape(layer):
    """The input shape a layer was built on (one input), or None."""
    return (getattr(layer, "_build_shapes_dict", None) or {}).get("input_shape")


def attributes(layer):
    """A layer's attributes by name, its sublayers included (on PyTorch a
    layer is a `torch.nn.Module`, which keeps its sublayers in `_modules`)."""
    found = dict(getattr(layer, "_modules", None) or {})
    found.update(vars(layer))
    return found


def has_state(layer):
    """Whether `layer` created state its forward may update: non-trainable
    variables, seed generators (Dropout), or sublayers that may."""
    return bool(layer._non_trainable_variables or getattr(layer, "_seed_generators", None)) or any(
        has_state(child) for child in children(layer)
    )
