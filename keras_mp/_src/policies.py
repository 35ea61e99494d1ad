"""Per-layer dtype policies: the levels applied to a model, by hand or by list.

Every decision is an ordinary Keras dtype policy on `layer.dtype_policy`; the
rule that set it is kept beside it (for `precision_summary`).
"""

import functools

import keras
from keras.src.models.functional import Functional

from keras_mp._src.levels import check_half_dtype
from keras_mp._src.levels import get_level

L = keras.layers

# O1 computes in half on these only: matrix multiplications and convolutions,
# where half precision pays and is numerically safe (Apex's and MindSpore's
# O1 white lists). Recurrent layers go with their cells.
ALLOW_LIST = tuple(
    getattr(L, name)
    for name in (
        "Dense",
        "EinsumDense",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
        "SeparableConv1D",
        "SeparableConv2D",
        "MultiHeadAttention",
        "GroupedQueryAttention",
        "RNN",
        "SimpleRNNCell",
        "LSTMCell",
        "GRUCell",
        "ConvLSTM1D",
        "ConvLSTM2D",
        "ConvLSTM3D",
    )
    if hasattr(L, name)
)

# O2 computes in half everywhere except on these: reductions over many values
# (normalisations) and exponentials (softmax), where float16's range and
# precision lose accuracy. The model's output layers are added per model.
DENY_LIST = tuple(
    getattr(L, name)
    for name in (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "UnitNormalization",
        "RMSNormalization",
        "SpectralNormalization",
        "Softmax",
    )
    if hasattr(L, name)
)

_RULE_ATTRIBUTE = "_keras_mp_rule"
_CASTS_OUTPUTS_ATTRIBUTE = "_keras_mp_float32_outputs"
_ENTRY_DTYPE_ATTRIBUTE = "_keras_mp_entry_dtype"


def _matches(layer, entries):
    for entry in entries:
        if isinstance(entry, str):
            if layer.name == entry:
                return True
        elif isinstance(layer, entry):
            return True
    return False


def _check_layer_list(value, argument):
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        value = (value,)
    try:
        entries = tuple(value)
    except TypeError:
        entries = None
    if entries is None or not all(
        isinstance(e, str)
        or (isinstance(e, type) and issubclass(e, keras.layers.Layer))
        for e in entries
    ):
        raise TypeError(
            f"`{argument}` must be a list of layer classes (subclasses of "
            f"`keras.layers.Layer`) or layer names (strings). "
            f"Received: {argument}={value!r}"
        )
    return entries


def _check_model(model, argument="model"):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"`{argument}` must be a Keras model or layer (a "
            f"`keras.layers.Layer`). Received: {argument}={model!r} of type "
            f"{type(model).__name__}"
        )


def _is_subclassed(model):
    return isinstance(model, keras.Model) and not isinstance(
        model, (keras.Sequential, Functional)
    )


def _output_layers(model):
    """Layers whose outputs are the model's outputs.

    Known for Sequential and functional models (recursively, when an output
    comes from a nested model). A subclassed model's outputs are whatever its
    `call` returns: the subclassed model itself is listed, and its outputs
    are cast to float32 (`_cast_outputs_to_float32`).
    """
    if _is_subclassed(model):
        return (model,)
    if isinstance(model, keras.Sequential):
        operations = model.layers[-1:]
    elif isinstance(model, keras.Model) and getattr(model, "_outputs", None):
        operations = [
            t._keras_history.operation
            for t in keras.tree.flatten(model._outputs)
            if getattr(t, "_keras_history", None) is not None
        ]
    else:
        return ()
    layers = []
    for operation in operations:
        if operation is model:
            continue
        if isinstance(operation, keras.Model):
            layers.extend(_output_layers(operation))
        else:
            layers.append(operation)
    return tuple(layers)


def _cast_outputs_to_float32(model, entry_dtype):
    """Makes a subclassed model's `call` take `entry_dtype` and return float32.

    Sequential and functional models get float32 outputs from float32 output
    layers; a subclassed model's `call` may end anywhere, so its floating
    outputs are cast on the way out. Its own policy is float32, so its
    inputs arrive in float32 (and `model.export` gets a float32 serving
    signature); inside `call` they are cast to the level's `entry_dtype`, as
    a mixed policy on the model would, so that raw ops in `call` (a residual
    `x + attention(x)`) see the same dtype as the layers' outputs.
    Idempotent; `entry_dtype` follows the latest level applied.
    """
    object.__setattr__(model, _ENTRY_DTYPE_ATTRIBUTE, entry_dtype)
    if getattr(model, _CASTS_OUTPUTS_ATTRIBUTE, False):
        return
    call = model.call

    @functools.wraps(call)
    def call_with_float32_outputs(*args, **kwargs):
        dtype = getattr(model, _ENTRY_DTYPE_ATTRIBUTE)
        if dtype != "float32":
            args, kwargs = keras.tree.map_structure(
                lambda x: _cast_float(x, dtype), (args, kwargs)
            )
        outputs = call(*args, **kwargs)
        return keras.tree.map_structure(_to_float32, outputs)

    object.__setattr__(model, "call", call_with_float32_outputs)
    object.__setattr__(model, _CASTS_OUTPUTS_ATTRIBUTE, True)


def _cast_float(x, dtype):
    """Casts a float32 tensor to `dtype`; anything else passes unchanged."""
    if not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return x
    if keras.backend.standardize_dtype(x.dtype) != "float32":
        return x
    return keras.ops.cast(x, dtype)


def _to_float32(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return x
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype in ("float16", "bfloat16"):
        return keras.ops.cast(x, "float32")
    return x


def _is_batchnorm(layer):
    return isinstance(layer, L.BatchNormalization)


def _decide(layer, level, half, keep_batchnorm_fp32, allow, deny, outputs):
    """(policy name, rule) for one layer at a level."""
    mixed = f"mixed_{half}"
    if any(layer is o for o in outputs):
        return "float32", "model output: float32"
    if level.half_compute == "none":
        return "float32", f"{level.name}: float32"
    if level.half_compute == "allow":
        if _matches(layer, allow):
            return mixed, f"{level.name} allow-list"
        return "float32", f"{level.name}: not on the allow-list"
    if level.half_compute == "deny":
        if _matches(layer, deny):
            return "float32", f"{level.name} deny-list"
        return mixed, f"{level.name}: half compute, float32 variables"
    # "all"
    if _is_batchnorm(layer) and keep_batchnorm_fp32:
        return "float32", f"{level.name}: keep_batchnorm_fp32=True"
    return half, f"{level.name}: half everywhere"


def apply_amp(
    model,
    level="O2",
    dtype="float16",
    keep_batchnorm_fp32=None,
    allow=None,
    deny=None,
):
    """Sets every layer's dtype policy for a precision level.

    The levels (Apex's O0-O3, MindSpore's `amp_level`):

    - `"O0"`: float32 everywhere (the accuracy baseline).
    - `"O1"`: half compute on the allow-list only (`ALLOW_LIST`: Dense,
      EinsumDense, convolutions, attention, recurrent cells), float32 variables.
    - `"O2"`: half compute everywhere except the deny-list (`DENY_LIST`:
      normalisations and Softmax) and the model's output layers; float32
      variables (master weights).
    - `"O3"`: half compute and half variables everywhere; BatchNorm too unless
      `keep_batchnorm_fp32=True`. A built model's weights are converted in
      place (same model, same variable objects, values rounded to half).

    The model's output layers compute in float32 at every level, so outputs
    and the loss are float32.

    Args:
        model: a Keras model (Sequential, functional or subclassed) or layer,
            built or not.
        level: one of `"O0"`, `"O1"`, `"O2"`, `"O3"`.
        dtype: the half dtype, `"float16"` or `"bfloat16"`.
        keep_batchnorm_fp32: bool or `None` (float32 BatchNorm except at O3).
        allow: layer classes or names to add to the allow-list (O1).
        deny: layer classes or names to add to the deny-list (O2).

    Returns:
        `model`, changed in place.

    Raises:
        TypeError: `model` is not a Keras layer, or `allow`/`deny` hold
            something other than layer classes and names.
        ValueError: unknown `level` or `dtype`.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.BatchNormalization(),
    ...                           keras.layers.Dense(2)])
    >>> _ = keras_mp.apply_amp(model, "O2")
    >>> [l.dtype_policy.name for l in model.layers]
    ['mixed_float16', 'float32', 'float32']
    """
    _check_model(model)
    level_spec = get_level(level)
    half = check_half_dtype(dtype)
    if keep_batchnorm_fp32 is None:
        keep_batchnorm_fp32 = level_spec.keep_batchnorm_fp32_default
    if not isinstance(keep_batchnorm_fp32, bool):
        raise TypeError(
            "`keep_batchnorm_fp32` must be True, False or None. "
            f"Received: keep_batchnorm_fp32={keep_batchnorm_fp32!r}"
        )
    allow = ALLOW_LIST + _check_layer_list(allow, "allow")
    deny = DENY_LIST + _check_layer_list(deny, "deny")
    outputs = _output_layers(model)
    decisions = []
    for layer in _layers(model):
        if _is_subclassed(layer) and (layer is model or any(layer is o for o in outputs)):
            # Its `call` is the model's forward pass: inputs arrive and
            # outputs leave in float32; the layers inside follow the level.
            policy, rule = "float32", f"{level_spec.name}: model, float32 inputs and outputs"
        elif _is_container(layer):
            # A container computes nothing itself; its policy casts its inputs.
            policy = (
                half
                if level_spec.half_compute == "all"
                else f"mixed_{half}"
                if level_spec.half_compute == "deny"
                else "float32"
            )
            rule = f"{level_spec.name}: container"
        else:
            policy, rule = _decide(
                layer, level_spec, half, keep_batchnorm_fp32, allow, deny, outputs
            )
        decisions.append((layer, (policy, rule)))
    _set_policies(model, decisions)
    entry_dtype = {"all": half, "deny": half}.get(level_spec.half_compute, "float32")
    for layer in outputs:
        if _is_subclassed(layer):
            _cast_outputs_to_float32(layer, entry_dtype)
    return model


def to_float(layer_or_model, dtype):
    """Manual mixed precision: a layer and all its sublayers compute in `dtype`.

    As MindSpore's `Cell.to_float`: `"float16"` or `"bfloat16"` gives the layer
    (and every layer inside it) half compute with float32 variables
    (`mixed_float16` / `mixed_bfloat16`); `"float32"` puts it back in full
    precision. Other layers are untouched.

    Args:
        layer_or_model: a Keras layer or model.
        dtype: `"float16"`, `"bfloat16"` or `"float32"`.

    Returns:
        `layer_or_model`, changed in place.
    """
    _check_model(layer_or_model, "layer_or_model")
    name = getattr(dtype, "name", dtype)
    if name not in ("float16", "bfloat16", "float32"):
        raise ValueError(
            "`dtype` must be one of float16, bfloat16, float32. "
            f"Received: dtype={dtype!r}"
        )
    policy = "float32" if name == "float32" else f"mixed_{name}"
    rule = f"to_float({name!r})"
    _set_policies(
        layer_or_model, [(layer, (policy, rule)) for layer in _layers(layer_or_model)]
    )
    return layer_or_model


class PrecisionSummary(str):
    """The text of `precision_summary`, with the rows as data in `.rows`."""

    rows = ()


def precision_summary(model, print_fn=None):
    """A per-layer table: compute dtype, variable dtype, and the rule that set it.

    Args:
        model: a Keras model or layer.
        print_fn: optional callable given the text (e.g. `print`).

    Returns:
        A `PrecisionSummary`: the table as a string (print it), with
        `.rows`, a list of dicts with keys `layer`, `class`, `compute_dtype`,
        `variable_dtype`, `policy` and `rule`.
    """
    _check_model(model)
    rows = []
    for layer in _layers(model):
        policy = layer.dtype_policy
        rows.append(
            {
                "layer": layer.path if getattr(layer, "path", None) else layer.name,
                "class": type(layer).__name__,
                "compute_dtype": policy.compute_dtype,
                "variable_dtype": policy.variable_dtype,
                "policy": policy.name,
                "rule": getattr(layer, _RULE_ATTRIBUTE, "Keras default"),
            }
        )
    columns = ("layer", "class", "compute_dtype", "variable_dtype", "rule")
    headers = ("Layer", "Class", "Compute", "Variables", "Rule")
    widths = [
        max([len(h)] + [len(str(r[c])) for r in rows])
        for h, c in zip(headers, columns)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    lines = [line, "-" * len(line)]
    for r in rows:
        lines.append("  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)))
    summary = PrecisionSummary("\n".join(line.rstrip() for line in lines))
    summary.rows = rows
    if print_fn is not None:
        print_fn(summary)
    return summary


def _layers(model):
    return list(model._flatten_layers(include_self=True, recursive=True))


def _is_container(layer):
    return isinstance(layer, keras.Model)


def _set_policy(layer, policy_name, rule):
    """Sets the policy; returns whether a built layer's variables changed."""
    policy = keras.dtype_policies.get(policy_name)
    layer.dtype_policy = policy
    object.__setattr__(layer, _RULE_ATTRIBUTE, rule)
    return layer.built and _convert_own_variables(layer, policy.variable_dtype)


def _set_policies(model, decisions):
    changed = False
    for layer, (policy_name, rule) in decisions:
        changed = _set_policy(layer, policy_name, rule) or changed
    if changed:
        _retrack_torch_parameters(model)


def _convert_own_variables(layer, variable_dtype):
    """Recasts a built layer's own float variables in place (same objects)."""
    changed = False
    for variable in list(layer._trainable_variables) + list(
        layer._non_trainable_variables
    ):
        current = keras.backend.standardize_dtype(variable.dtype)
        if not keras.backend.is_float_dtype(current) or current == variable_dtype:
            continue
        value = keras.ops.cast(variable.value, variable_dtype)
        variable._dtype = variable_dtype
        variable._initialize(value)
        changed = True
    return changed


def _retrack_torch_parameters(model):
    """PyTorch modules register parameters by object, in every ancestor."""
    for layer in _layers(model):
        if hasattr(layer, "_torch_params"):
            layer._track_variables()

