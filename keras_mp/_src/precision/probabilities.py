"""Probabilities in float32 wherever they are computed, as under torch.autocast.

- A layer's own softmax, log_softmax or sigmoid (`Dense(10,
  activation="softmax")`, anywhere in the model) runs on its inputs cast to
  float32 while the layer's matmul runs in half: its outputs are float32.
  The activation is replaced once, when the layer's policy is set, by a
  function of the same name and module (`float32_activation`): the layer's
  config and saved file name the user's activation, and nothing changes
  while the layer runs, so threads calling the model share it safely.
- A layer that is nothing but a probability (`Softmax`, `Activation`) is
  float32 at every level (`rules.py`).
- A layer that is nothing but a softmax, computing in float32
  and returning half to a half consumer (an attention's probabilities on
  their way to its second matmul, `boundaries.py`), keeps its half output
  for the backward pass, not its float32 one (`kept_in_half`): the
  gradient is computed in float32 from it, as Megatron's and Apex's fused
  softmax do. Its forward values are unchanged (its consumer reads half).
- A layer that only moves values (`Reshape`, `Flatten`, `layer_kinds.
  DATA_MOVEMENT`) passes on the dtype it receives: a float32 probability on
  its way to an output stays float32, a half activation stays half.
"""

import functools

import keras

from keras_mp._src import backends
from keras_mp._src.precision.layer_kinds import DATA_MOVEMENT
from keras_mp._src.precision.layer_kinds import probability_activation

_ORIGINAL = "_keras_mp_float32_of"


def float32_activation(activation):
    """`activation` computed on its input cast to float32 (same name, module
    and signature, so that Keras serializes it as `activation`)."""
    if getattr(activation, _ORIGINAL, None) is not None:
        return activation

    @functools.wraps(activation)
    def in_float32(x, *args, **kwargs):
        return activation(keras.ops.cast(x, "float32"), *args, **kwargs)

    setattr(in_float32, _ORIGINAL, activation)
    return in_float32


def original_activation(activation):
    """The user's activation behind `float32_activation`'s (itself otherwise)."""
    return getattr(activation, _ORIGINAL, None) or activation


def computes_in_float32(layer):
    """Whether `layer` runs its probability activation in float32."""
    return getattr(getattr(layer, "activation", None), _ORIGINAL, None) is not None


def _own_activation(layer):
    """Whether the layer applies its `activation` to its outputs itself: not
    a recurrent layer (its `activation` is its cell's, a read-only
    property) nor a cell (its activation feeds the state it carries)."""
    if isinstance(getattr(type(layer), "activation", None), property):
        return False
    return not hasattr(layer, "state_size")


def set_probabilities(layers):
    """For each layer (its policy set): a probability activation in float32
    where it computes in half, the user's own where it computes in float32;
    data movement in the dtype it receives."""
    for layer in layers:
        if isinstance(layer, DATA_MOVEMENT):
            # Keras casts a layer's float inputs to its compute dtype first.
            object.__setattr__(layer, "_convert_input_args", False)
            continue
        if probability_activation(layer) is None or not callable(layer.activation):
            continue
        if not _own_activation(layer):
            continue
        compute = keras.backend.standardize_dtype(layer.compute_dtype)
        wanted = original_activation(layer.activation)
        if compute in ("float16", "bfloat16"):
            wanted = float32_activation(wanted)
        if wanted is not layer.activation:
            object.__setattr__(layer, "activation", wanted)


def _gradient(layer):
    """`(y, upstream) -> dx` of a layer that is nothing but a softmax, in
    float32 from its output `y`; None for any other layer (a log_softmax's
    half output would lose its small probabilities' digits)."""
    # The layer's own `call`, not a subclass's (a temperature's `x / T`
    # first: another gradient).
    if type(layer).call is keras.layers.Softmax.call:
        axes = layer.axis if isinstance(layer.axis, (tuple, list)) else (layer.axis,)
        axis = tuple(axes) if len(axes) > 1 else axes[0]
    elif type(layer).call is keras.layers.Activation.call:
        # Keras's own softmax only (a function of the user's named so may
        # take another axis). Not a sigmoid: near 1 its half output rounds
        # to 1 and `y * (1 - y)` to 0 (bfloat16 at 6.5 and beyond).
        if original_activation(layer.activation) is not keras.activations.softmax:
            return None
        axis = -1
    else:
        return None
    return softmax_gradient(axis)


def softmax_gradient(axis):
    """`(y, upstream) -> dx` of a softmax over `axis` (an int or a tuple), in
    float32 from its output `y`."""
    ops = keras.ops

    def gradient(y, g):
        return y * (g - ops.sum(g * y, axis=axis, keepdims=True))

    gradient.axis = axis  # for a backend's own form of the same numbers
    return gradient


def keeps_half(layer):
    """Whether `layer`, returning half, can keep its half output for the
    backward pass (`kept_in_half`)."""
    return _gradient(layer) is not None


def kept_in_half(layer, call, dtype, args, kwargs):
    """`layer`'s `call` in float32 returned in `dtype`, its backward pass
    keeping the half output only (`backends.current.saved_in_half`)."""
    inputs, rest = args[0], args[1:]
    if keras.backend.standardize_dtype(getattr(inputs, "dtype", "")) != "float32":
        return keras.ops.cast(call(*args, **kwargs), dtype)
    return backends.current.saved_in_half(
        lambda x: call(x, *rest, **kwargs), _gradient(layer), inputs, dtype
    )
