"""A float32 normalisation of a half model: its half input kept for the
backward pass, its float32 arithmetic computed again there (PyTorch).

A normalisation the rules keep in float32 (`rules.py`) inside a half block
casts its half input to float32 and computes on that; PyTorch's autograd
saves what its ops read, the float32 copy (`x * rsqrt(mean(x**2))` saves
`x` twice over and its product), so the step keeps twice the bytes of
Keras's mixed policy, under which a norm of KerasHub's or the user's
(T5's `T5LayerNorm`) computes in half: T5 at O2 saved 1.21x Keras's bytes
(issue 65). Here such a layer is one `torch.autograd.Function`: its
forward runs the layer's float32 `call` without recording, and keeps only
its half inputs; its backward converts them again (exactly: half to
float32 loses nothing) and differentiates the same `call`. The numbers are
the float32 layer's, to the bit; the cost is a norm's forward again, a
memory-bound pass, in the backward (Megatron's and Apex's memory-efficient
norms trade the same way).

Keras's own normalisations (`LayerNormalization`, `RMSNormalization`,
`GroupNormalization`) compute in float32 inside under Keras's mixed policy
too, and save as much: they are left as they are. So are layers with state
their forward updates (`BatchNormalization`'s moving statistics: a second
forward would update them again) and layers called with tensors in keyword
arguments. JAX's compiled step decides what it keeps (XLA keeps the half
source of a convert where it pays), TensorFlow's graph likewise: the rule
acts on PyTorch only (`backends.current.RECOMPUTES_FROM_HALF`).
"""

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_kinds

_ATTRIBUTE = "_keras_mp_recomputed"
# The layer's own `_convert_input_args` before the rule turned it off.
_CONVERTS_ATTRIBUTE = "_keras_mp_converts_inputs"
_HALF = ("float16", "bfloat16")


def applies(layer):
    """Whether `layer`, float32 inside a half caller, is recomputed."""
    return (
        backends.current.RECOMPUTES_FROM_HALF
        and layer_kinds.is_normalization(layer)
        and not type(layer).__module__.startswith("keras.")
        and not isinstance(layer, keras.layers.BatchNormalization)
        # Created state (moving statistics, a Dropout's seed): a second
        # forward would update it again. Frozen weights are no state.
        and not keras_internals.has_state(layer)
        and getattr(layer, "_convert_input_args", False)
        and keras.backend.standardize_dtype(layer.compute_dtype) == "float32"
    )


def is_on(layer):
    return getattr(layer, _ATTRIBUTE, False)


def set_recomputed(layer, on):
    """Turns the rule on or off for `layer` (its wrapper, `boundaries.py`,
    must be installed when on). Keras no longer casts its inputs: `call`
    below does, so that it holds the half ones."""
    if bool(on) == is_on(layer):
        return
    object.__setattr__(layer, _ATTRIBUTE, bool(on))
    if on:
        object.__setattr__(
            layer,
            _CONVERTS_ATTRIBUTE,
            (layer._convert_input_args, layer._allow_non_tensor_positional_args),
        )
        # A direct call on NumPy arrays: converted by `call` below.
        object.__setattr__(layer, "_convert_input_args", False)
        object.__setattr__(layer, "_allow_non_tensor_positional_args", True)
    else:
        converts, non_tensors = getattr(layer, _CONVERTS_ATTRIBUTE, (True, False))
        object.__setattr__(layer, "_convert_input_args", converts)
        object.__setattr__(layer, "_allow_non_tensor_positional_args", non_tensors)


def call(layer, call, args, kwargs):
    """`call(*args, **kwargs)` with Keras's input conversion; recomputed in
    the backward pass where every input is a half tensor."""

    def convert(x):  # as Keras's `Layer.__call__` would have (masks kept)
        mask = keras_internals.get_keras_mask(x) if keras.ops.is_tensor(x) else None
        y = layer.dtype_policy.convert_input(x, layer.autocast, layer.input_dtype)
        if mask is not None:
            keras_internals.set_keras_mask(y, mask)
        return y

    inputs = list(args)
    if (
        inputs
        and not any(keras.ops.is_tensor(v) for v in keras.tree.flatten(kwargs))
        and all(
            keras.ops.is_tensor(x) and keras.backend.standardize_dtype(x.dtype) in _HALF
            for x in inputs
        )
    ):
        # The values the forward reads (a `stateless_call`'s too): the
        # backward computes again from the same ones, whose gradients it gives.
        variables = list(layer.variables)
        values = [v.value for v in variables]

        def function(half, values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return call(*[convert(x) for x in half], **kwargs)

        try:
            return backends.current.recomputed_from_half(function, inputs, values)
        except TypeError:
            # A norm returning a structure (or failing): as written from now
            # on, which raises a failure of its own again.
            set_recomputed(layer, False)
    args, kwargs = keras.tree.map_structure(convert, (args, kwargs))
    return call(*args, **kwargs)
