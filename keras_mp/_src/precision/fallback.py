"""Layers of your own that cannot compute in half: found at their first call,
kept in float32.

A layer's own `call` may mix its half inputs with a float32 tensor of its
own: keras-io's VAE samples `z_mean + ops.exp(0.5 * z_log_var) *
keras.random.normal(...)`, whose draw is float32 (floatx) whatever the
layer's policy; a float32 constant or weight does the same. TensorFlow
refuses float16 x float32 ("Input 'y' of 'Mul' Op has type float32 that
does not match type float16"), under Keras's own mixed policies too.

keras_mp cannot read a layer's code, so it watches the first call instead:
a layer defined outside Keras and KerasHub that computes in half has its
`call` wrapped; when the call fails with an error that names a half dtype,
the call is run again in float32 (its floating inputs cast to float32, its
weights read in float32, its outputs cast back to the dtype its caller
expects). When that succeeds the layer computes in float32 from then on, its
reason is in `precision_summary`, and a warning names it once. When it fails
too, the error names the layer and the fix (`deny=[TheLayer]`), raised from
the backend's. The retry happens while the step is traced (TensorFlow, JAX)
or run (PyTorch): the failed ops of the first try are never run.

A backend may also lack a half *gradient* kernel on a device (PyTorch's CPU
backward of a float16 convolution has failed so): the failure comes in
`backward()`, after every layer's call has returned, and its message names
no layer. On PyTorch, whose step runs eagerly, a failed step of a model
that computes in half is answered by a probe (`find_layers_failing_in_half`):
each half layer with weights, built on one input, runs forward and backward
alone on a small random batch in its dtype; those that fail compute in
float32 from then on (as above: named once, in `precision_summary`) and the
step runs again. When none fails alone, the error says so, and names the
fix.
"""

import functools
import warnings

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_tree import layers_in_order
from keras_mp._src.precision.levels import HALF_DTYPES

_INSTALLED = "_keras_mp_fallback_installed"
# The reason a layer computes in float32, once it fell back.
FELL_BACK = "_keras_mp_fell_back"
_HALF_NAMES = ("float16", "bfloat16", "half", "bf16")


def watch(layer):
    """Wraps `layer.call` (once) so that a half-precision failure falls back."""
    if getattr(layer, _INSTALLED, False) or not hasattr(layer, "call"):
        return
    object.__setattr__(layer, "call", _with_fallback(layer, layer.call))
    object.__setattr__(layer, _INSTALLED, True)


def fell_back(layer):
    """The reason `layer` computes in float32 after a failure in half, or None."""
    return getattr(layer, FELL_BACK, None)


def _names_a_half_dtype(error):
    message = str(error).lower()
    return any(name in message for name in _HALF_NAMES)


def _with_fallback(layer, call):
    @functools.wraps(call)
    def call_with_fallback(*args, **kwargs):
        if fell_back(layer) is not None:
            return _in_float32(layer, call, args, kwargs)
        half = keras.backend.standardize_dtype(layer.compute_dtype)
        if half not in HALF_DTYPES:
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        except Exception as error:
            if not _names_a_half_dtype(error):
                raise
            try:
                outputs = _in_float32(layer, call, args, kwargs)
            except Exception:
                raise _named(layer, half, error) from error
            _fall_back(layer, half, error)
            return outputs

    return call_with_fallback


def _in_float32(layer, call, args, kwargs):
    """`call` in float32: floating inputs and weights read in float32, the
    outputs cast back to the layer's compute dtype (what its caller expects)."""
    args, kwargs = keras.tree.map_structure(lambda x: _cast(x, "float32"), (args, kwargs))
    with keras_internals.AutocastScope("float32"):
        outputs = call(*args, **kwargs)
    dtype = keras.backend.standardize_dtype(layer.compute_dtype)
    return keras.tree.map_structure(lambda x: _cast(x, dtype), outputs)


def _cast(x, dtype):
    if not keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor):
        return x
    current = keras.backend.standardize_dtype(x.dtype)
    if current == dtype or current not in HALF_DTYPES + ("float32",):
        return x
    return keras.ops.cast(x, dtype)


def first_line(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2])
    return text if len(text) <= 200 else text[:197] + "..."


def find_layers_failing_in_half(model):
    """The layers of `model` that fail forward and backward alone in half.

    Each leaf layer that computes in half, has trainable weights and was
    built on one input runs on a random batch of 2 in its compute dtype;
    the gradients are cleared after. `(layer, error)` for each that fails.
    """
    failing = []
    for layer in layers_in_order(model):
        half = keras.backend.standardize_dtype(layer.compute_dtype)
        shape = keras_internals.built_input_shape(layer)
        if (
            half not in HALF_DTYPES
            or fell_back(layer) is not None
            or not layer.trainable_weights
            or layer_tree.has_sublayers(layer)
            or not isinstance(shape, (tuple, list))
            or any(not isinstance(d, int) for d in shape[1:])
        ):
            continue
        x = keras.ops.cast(keras.random.normal((2,) + tuple(shape[1:])), half)
        try:
            _forward_and_backward(layer, x)
        except Exception as error:
            failing.append((layer, error))
        finally:
            for variable in layer.trainable_weights:
                variable.value.grad = None
    return failing


def _forward_and_backward(layer, x):
    import torch

    with torch.enable_grad():
        outputs = layer(x)
        total = sum(
            keras.ops.sum(keras.ops.cast(y, "float32")) for y in keras.tree.flatten(outputs)
        )
        total.backward()


def keep_in_float32(layer, reason):
    """From now on `layer` computes in float32 (`_in_float32`), with `reason`."""
    watch(layer)
    object.__setattr__(layer, FELL_BACK, reason)
    warnings.warn(
        f"keras_mp: layer {layer.name!r} ({type(layer).__name__}) {reason}; it "
        f"computes in float32 from now on (its inputs and outputs cast). To "
        f"say so yourself: deny=[{type(layer).__name__}] in apply_amp "
        f"(amp_deny=[{type(layer).__name__}] in compile).",
        stacklevel=3,
    )


def may_come_from_half(error):
    """Whether a failed step's error may be a layer's half kernel: not an
    error about devices (tensors on a GPU and on the CPU), which no
    precision explains."""
    text = str(error)
    return "same device" not in text and "device mismatch" not in text.lower()


def note_no_layer_fails_alone(error):
    """Adds to the error of a half step, which no layer's probe explains,
    what was tried and the fix (the error itself is left as it is: it may
    be a bug of the step's own)."""
    if hasattr(error, "add_note"):  # Python 3.11
        error.add_note(
            "keras_mp: the model computes in half precision, and no layer of "
            "it fails alone in half on this device. If the error is a layer's, "
            "keep it in float32: deny=[TheLayer] in apply_amp (amp_deny=[...] "
            "in compile), or try amp_level='O1'."
        )


def _deny_entry(layer):
    """What `deny=[...]` takes for it: its class, or a `Lambda`'s name (the
    class would deny every Lambda)."""
    if isinstance(layer, keras.layers.Lambda):
        return repr(layer.name)
    return type(layer).__name__


def _fall_back(layer, half, error):
    reason = f"mixes {half} with float32 in its own call: float32"
    object.__setattr__(layer, FELL_BACK, reason)
    name = _deny_entry(layer)
    warnings.warn(
        f"keras_mp: layer {layer.name!r} ({type(layer).__name__}) cannot compute in {half}: its "
        f"own call mixes {half} with float32 ({first_line(error)}). It computes "
        f"in float32 from now on (its inputs and outputs cast). To say so "
        f"yourself: deny=[{name}] in apply_amp (amp_deny=[{name}] in compile).",
        stacklevel=4,
    )


def _named(layer, half, error):
    name = _deny_entry(layer)
    return TypeError(
        f"keras_mp: layer {layer.name!r} ({type(layer).__name__}) failed in {half}, and in "
        f"float32 too: {first_line(error)}. If it must compute in float32, "
        f"keep it there with deny=[{name}] in apply_amp (amp_deny=[{name}] "
        f"in compile)."
    )
