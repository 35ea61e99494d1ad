"""Per-layer dtype policies: the levels applied to a model, by hand or by list.

Every decision is an ordinary Keras dtype policy on `layer.dtype_policy`; the
rule that set it is kept beside it (for `precision_summary`).
"""

import dataclasses
import functools
import threading
import warnings

import keras
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask
from keras.src.models.functional import Functional

from keras_mp._src import backends
from keras_mp._src import fallback
from keras_mp._src import table
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

# Keras's attention layers call `ops.dot_product_attention`, which on JAX
# asks for float16 x float16 -> float32 logits: XLA's CPU backend has no
# such dot_general ("F16_F16_F32"). On JAX's CPU they compute in float32 at
# float16 levels; their projections (EinsumDense sublayers) stay half.
_FUSED_ATTENTION = tuple(
    getattr(L, name) for name in ("MultiHeadAttention", "GroupedQueryAttention") if hasattr(L, name)
)

# Packages whose composite layers are written for Keras's mixed policies (they
# run under them in production): at O2 they compute in half. A layer defined
# anywhere else that contains other layers computes its own arithmetic in
# float32 at O2 in float16 (see `_runs_unknown_arithmetic`).
_MIXED_PRECISION_AWARE_PACKAGES = ("keras", "keras_hub", "keras_nlp", "keras_cv", "keras_rs")


def _from_aware_package(layer):
    """Whether `layer`'s class is Keras's, KerasHub's, ... (written for
    Keras's mixed policies)."""
    return type(layer).__module__.split(".", 1)[0] in _MIXED_PRECISION_AWARE_PACKAGES


def _is_attention(layer):
    """Keras's attention layers, and those of KerasHub (`LlamaAttention`,
    ...), whose own `call` computes the attention (most of them through
    `ops.dot_product_attention`)."""
    return isinstance(layer, _FUSED_ATTENTION) or (
        type(layer).__name__.endswith("Attention") and _from_aware_package(layer)
    )


_RULE_ATTRIBUTE = "_keras_mp_rule"
# The rule of a layer keras_mp never set.
_KERAS_DEFAULT_RULE = "Keras default"
_CASTS_ATTRIBUTE = "_keras_mp_boundary_casts"
_ENTRY_DTYPE_ATTRIBUTE = "_keras_mp_entry_dtype"
_OUTPUT_DTYPE_ATTRIBUTE = "_keras_mp_output_dtype"
# On a model held by a subclassed model: the dtype it returns when called
# from outside that model's `call` (its `train_step`, `compute_loss`).
_OUTSIDE_DTYPE_ATTRIBUTE = "_keras_mp_outside_dtype"
# How many subclassed models' own `call`s are running (this thread).
_MODEL_CALLS = threading.local()
# Set on a model that `apply_amp` or `to_float` was given (see `is_amp_model`).
_AMP_MODEL_ATTRIBUTE = "_keras_mp_amp_model"
_LAYER_LISTS_ATTRIBUTE = "_keras_mp_layer_lists"
_LOADABLE_CONFIG_ATTRIBUTE = "_keras_mp_loadable_config"


def _mark_amp_model(model):
    if isinstance(model, keras.Model):
        object.__setattr__(model, _AMP_MODEL_ATTRIBUTE, True)


def is_amp_model(model):
    """Whether keras_mp set this model's precision (`apply_amp`, `to_float`,
    `compile(amp_level=...)`): what keras_mp changes of Keras's behaviour
    beyond the policies applies to such models only."""
    return getattr(model, _AMP_MODEL_ATTRIBUTE, False)


def _matches(layer, entries):
    for entry in entries:
        if isinstance(entry, str):
            if layer.name == entry:
                return True
        elif isinstance(entry, keras.layers.Layer):
            if layer is entry:
                return True
        elif isinstance(layer, entry):
            return True
    return False


def _is_normalization(layer):
    """A normalisation layer: Keras's, or a class named `...Norm(alization)`.

    KerasHub's models bring their own (Gemma's `RMSNormalization`, T5's
    `T5LayerNorm`, ...), which are not Keras's classes; the name is the
    convention they all follow.
    """
    return any(cls.__name__.endswith(("Norm", "Normalization")) for cls in type(layer).__mro__)


def _denied(layer, deny):
    return _matches(layer, deny) or _is_normalization(layer)


def check_layer_list(value, argument):
    if value is None:
        return ()
    if isinstance(value, (str, type, keras.layers.Layer)):
        value = (value,)
    try:
        entries = tuple(value)
    except TypeError:
        entries = None
    if entries is None or not all(
        isinstance(e, (str, keras.layers.Layer))
        or (isinstance(e, type) and issubclass(e, keras.layers.Layer))
        for e in entries
    ):
        raise TypeError(
            f"`{argument}` must be a list of layer classes (subclasses of "
            f"`keras.layers.Layer`), layer names (strings) or layers. "
            f"Received: {argument}={value!r}"
        )
    return entries


def check_model(model, argument="model"):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"`{argument}` must be a Keras model or layer (a "
            f"`keras.layers.Layer`). Received: {argument}={model!r} of type "
            f"{type(model).__name__}"
        )


def _is_subclassed(model):
    return isinstance(model, keras.Model) and not isinstance(model, (keras.Sequential, Functional))


def _output_layers(model):
    """Layers whose outputs are the model's outputs.

    Known for Sequential and functional models (recursively, when an output
    comes from a nested model). A subclassed model's outputs are whatever its
    `call` returns: the subclassed model itself is listed, and its outputs
    are cast to float32 (`_set_boundary_casts`). So are the outputs of the
    models it holds (a GAN's generator and discriminator, a VAE's encoder
    and decoder, a distiller's student and teacher): a `train_step` or
    `compute_loss` of its own computes its losses from them, as from the
    model's own outputs.
    """
    if _is_subclassed(model):
        outputs = [model]
        for child in model._flatten_layers(include_self=False, recursive=False):
            if _is_graph(child):
                outputs.extend(_output_layers(child))
            elif _is_subclassed(child):
                outputs.append(child)
        return tuple(outputs)
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


def _set_boundary_casts(layer, entry_dtype=None, output_dtype=None):
    """Makes `layer` take `entry_dtype` inside its `call` and return `output_dtype`.

    - `entry_dtype` (subclassed models only): the model's own policy is
      float32, so its inputs arrive in float32 (and `model.export` gets a
      float32 serving signature); inside `call` they are cast to the
      level's dtype, as a mixed policy on the model would, so that raw ops
      in `call` (a residual `x + attention(x)`) see the same dtype as the
      layers' outputs.
    - `output_dtype`: the layer's floating outputs are cast to it on the way
      out (Keras masks kept). Set for a model's float32 outputs, and for a
      sublayer whose compute dtype differs from the layer that calls it
      (`apply_amp`'s boundary rule), so that the caller's own arithmetic
      on its sublayers' outputs sees one dtype.

    `None` turns a cast off. Idempotent: the wrapper is installed once and
    reads the latest dtypes at each call.
    """
    installed = getattr(layer, _CASTS_ATTRIBUTE, False)
    if not installed and entry_dtype is None and output_dtype is None:
        return
    object.__setattr__(layer, _ENTRY_DTYPE_ATTRIBUTE, entry_dtype)
    object.__setattr__(layer, _OUTPUT_DTYPE_ATTRIBUTE, output_dtype)
    if installed:
        return
    # A quantized layer (int8, float8) runs `quantized_call`, not `call`:
    # both carry the casts, so quantizing after `apply_amp` keeps them too.
    for method in ("call", "quantized_call"):
        if hasattr(layer, method):
            object.__setattr__(layer, method, _with_boundary_casts(layer, getattr(layer, method)))
    object.__setattr__(layer, _CASTS_ATTRIBUTE, True)


def _inside_a_model_call():
    return getattr(_MODEL_CALLS, "depth", 0) > 0


def _with_boundary_casts(layer, call):
    @functools.wraps(call)
    def call_with_boundary_casts(*args, **kwargs):
        entry = getattr(layer, _ENTRY_DTYPE_ATTRIBUTE)
        if entry is None:
            outputs = call(*args, **kwargs)
        else:
            if entry != "float32":
                args, kwargs = keras.tree.map_structure(
                    lambda x: _cast_float(x, entry), (args, kwargs)
                )
            _MODEL_CALLS.depth = getattr(_MODEL_CALLS, "depth", 0) + 1
            try:
                outputs = call(*args, **kwargs)
            finally:
                _MODEL_CALLS.depth -= 1
        target = getattr(layer, _OUTPUT_DTYPE_ATTRIBUTE)
        outside = getattr(layer, _OUTSIDE_DTYPE_ATTRIBUTE, None)
        if outside is not None and not _inside_a_model_call():
            target = outside
        if target is None:
            return outputs
        return keras.tree.map_structure(lambda x: _cast_half_or_float32(x, target), outputs)

    return call_with_boundary_casts


def _cast_float(x, dtype):
    """Casts a float32 tensor to `dtype`; anything else passes unchanged."""
    if not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return x
    if keras.backend.standardize_dtype(x.dtype) != "float32":
        return x
    return keras.ops.cast(x, dtype)


_COMPUTE_FLOATS = ("float16", "bfloat16", "float32")


def _cast_half_or_float32(x, dtype):
    """Casts a float16/bfloat16/float32 tensor to `dtype`, keeping its Keras mask.

    Anything else (integers, booleans, float64, None) passes unchanged.
    """
    current = getattr(x, "dtype", None)
    if current is None or not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return x
    current = keras.backend.standardize_dtype(current)
    if current == dtype or current not in _COMPUTE_FLOATS:
        return x
    mask = get_keras_mask(x) if keras.ops.is_tensor(x) else None
    y = keras.ops.cast(x, dtype)
    if mask is not None:
        set_keras_mask(y, mask)
    return y


# Keras's categorical and text preprocessing layers: their outputs are
# indices, one-hot vectors, counts and bins, exact in float32. In half, hash
# bins and vocabulary indices above 2048 (float16) or 256 (bfloat16) round
# to their neighbours', bin boundaries move, and TensorFlow's bincount has
# no half kernel. Keras pins most of them to `floatx()` under any global
# policy; keras_mp keeps them in float32 at every level.
_EXACT_PREPROCESSING = tuple(
    getattr(L, name)
    for name in (
        "CategoryEncoding",
        "Discretization",
        "HashedCrossing",
        "Hashing",
        "IntegerLookup",
        "StringLookup",
        "TextVectorization",
    )
    if hasattr(L, name)
) + ((keras.utils.FeatureSpace,) if hasattr(keras.utils, "FeatureSpace") else ())


def _kept_rule(layer):
    """The rule that keeps `layer`'s own policy at every level, or None.

    A quantized layer (its kernel is int8 or float8) and a layer that
    computes in a dtype that is not a float (Hashing's int64 bins,
    StringLookup's strings, a user's `dtype="int32"`) keep theirs: a float
    policy would change what they compute, not its precision.
    """
    policy = layer.dtype_policy
    if policy.quantization_mode is not None:
        return f"quantized ({policy.name}): kept"
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    if not keras.backend.is_float_dtype(compute):
        return f"{compute} outputs: kept"
    return None


def _is_batchnorm(layer):
    return isinstance(layer, L.BatchNormalization)


def _decide(
    layer, level, half, keep_batchnorm_fp32, allow, deny, outputs, inside_allowed, parent=None
):
    """(policy name, rule) for one layer at a level.

    `inside_allowed`: the layer sits inside an allow-listed layer (O1), whose
    sublayers compute with it, but for the deny-list. `parent`: the layer
    that calls it, if any.
    """
    mixed = f"mixed_{half}"
    if any(layer is o for o in outputs):
        return "float32", "model output: float32"
    if isinstance(layer, _EXACT_PREPROCESSING):
        return "float32", "indices, counts and bins: float32 at every level"
    if isinstance(layer, L.Normalization):
        # Fixed statistics (`adapt`ed, not trained), converted to the compute
        # dtype when built: in half they would change on every reload.
        return "float32", "input statistics: float32 at every level"
    if level.half_compute == "none":
        return "float32", f"{level.name}: float32"
    if _matches(layer, deny[len(DENY_LIST) :]):
        # The user's `deny=` wins at every level, over the allow-list too.
        return "float32", f"{level.name}: deny=, float32"
    user_allowed = _matches(layer, allow[len(ALLOW_LIST) :])
    if (
        half == "float16"
        and level.half_compute in ("allow", "deny")
        and type(layer).__name__ in _BEYOND_FLOAT16
        and not user_allowed
    ):
        reason = _BEYOND_FLOAT16[type(layer).__name__]
        return "float32", f"{level.name}: {reason}, own arithmetic in float32"
    if _is_attention(layer) and backends.current.half_attention_needs_float32(half):
        _warn_jax_cpu_attention_once()
        return "float32", f"{level.name}: attention on JAX's CPU, float32 (no float16 dot there)"
    if _is_router(layer, parent) and not user_allowed:
        return "float32", f"{level.name}: expert router, float32"
    if level.half_compute in ("deny", "all") and _routes_experts(layer) and not user_allowed:
        return "float32", f"{level.name}: expert routing in float32 (experts in half)"
    if (
        half == "float16"
        and level.half_compute == "deny"
        and _runs_unknown_arithmetic(layer)
        and not user_allowed
    ):
        return "float32", f"{level.name}: own arithmetic in float32 (your layer; allow= for half)"
    if level.half_compute == "allow":
        if _matches(layer, allow):
            return mixed, f"{level.name} allow-list"
        if inside_allowed and not _denied(layer, deny):
            return mixed, f"{level.name}: inside an allow-listed layer"
        if inside_allowed:
            return "float32", f"{level.name} deny-list"
        return "float32", f"{level.name}: not on the allow-list"
    if level.half_compute == "deny":
        if _denied(layer, deny):
            return "float32", f"{level.name} deny-list"
        return mixed, f"{level.name}: half compute, float32 variables"
    # "all"
    if _is_batchnorm(layer) and keep_batchnorm_fp32:
        return "float32", f"{level.name}: keep_batchnorm_fp32=True"
    return half, f"{level.name}: half everywhere"


# Library layers whose own `call` computes what float16 cannot hold (NaN
# under Keras's `mixed_float16`), and why. Their sublayers (projections,
# MLPs) still compute in half; their own arithmetic in float32.
_MASKS = "masks with -1e9"
_BEYOND_FLOAT16 = {
    # `-1e9` is `-inf` in float16, and `0 * -inf` is NaN. T5's attention
    # builds its mask itself; T5Gemma's and T5Gemma2's encoder and decoder
    # layers build theirs (`(1 - mask) * -1e9` in the hidden states' dtype),
    # which their attention layers add to the logits: a padded query past the
    # sliding window then has only `-inf` logits, and its softmax is NaN,
    # which the values' matmul spreads to every position.
    "T5MultiHeadAttention": _MASKS,
    "T5GemmaEncoderLayer": _MASKS,
    "T5GemmaDecoderLayer": _MASKS,
    "T5GemmaAttention": _MASKS,
    "T5Gemma2EncoderLayer": _MASKS,
    "T5Gemma2DecoderLayer": _MASKS,
    "T5Gemma2Attention": _MASKS,
    "T5Gemma2MergedAttention": _MASKS,
    # RWKV-7's time mix normalizes its keys with `rsqrt(sum(k**2) + 1e-12)`:
    # 1e-12 is 0 in float16, and a padded token's keys (zeroed) give
    # `0 * inf`.
    "RWKV7TimeMix": "normalizes with eps 1e-12 (0 in float16)",
    # Qwen3.5's gated delta net L2-normalizes its queries and keys,
    # `x * rsqrt(sum(x**2) + 1e-6)`, before its float32 recurrence: for a
    # short key the gradient of rsqrt (`-rsqrt(s)**3 / 2`, up to 5e8) is inf
    # in float16, and every step overflows whatever the loss scale.
    "Qwen3_5GatedDeltaNet": "L2-normalizes in its own code (rsqrt's gradient overflows float16)",
}


def _routes_experts(layer):
    """A mixture-of-experts block: KerasHub's `...SparseMoeBlock`, `...MoEBlock`.

    Its own `call` routes: router softmax, top-k, the routing weights and the
    load-balancing loss. Routing in half is unstable (Switch Transformer's
    "selective precision" keeps the router in float32), and KerasHub's
    load-balancing loss multiplies the half routing weights by a float32
    padding mask, which TensorFlow refuses (Keras's own mixed policies fail
    there). The experts, its sublayers, compute in half as the level says;
    the router's projection in float32 (`_is_router`).
    """
    return type(layer).__name__.endswith(("MoeBlock", "MoEBlock"))


def _is_router(layer, parent):
    """A mixture-of-experts router: a `...Router` layer, or the projection of
    an expert block to one logit per expert.

    In half, near ties between experts' logits round to the same value and
    top-k picks another expert: the output jumps. The projection is tiny
    (hidden size x experts); Switch Transformer computes it in float32.
    """
    if type(layer).__name__.endswith("Router"):
        return True
    experts = getattr(parent, "num_experts", None)
    return (
        experts is not None
        and _routes_experts(parent)
        and isinstance(layer, L.Dense)
        and layer.units == experts
    )


def _runs_unknown_arithmetic(layer):
    """Whether `layer`'s own `call` is code keras_mp knows nothing of.

    True for a layer with sublayers whose class is defined outside Keras and
    KerasHub (a user's attention block or subclassed model). Its own
    arithmetic may hold constants outside float16's range: the tutorial's
    attention mask `logits += mask * -1e9` is `0 * -inf = nan` in float16.
    """
    if _is_graph(layer) or _from_aware_package(layer):
        return False
    return any(True for _ in layer._flatten_layers(include_self=False, recursive=False))


_warned_jax_cpu_attention = False


def _warn_jax_cpu_attention_once():
    global _warned_jax_cpu_attention
    if _warned_jax_cpu_attention:
        return
    _warned_jax_cpu_attention = True
    warnings.warn(
        "keras_mp: JAX's CPU backend has no float16 x float16 -> float32 "
        "matmul, which Keras's dot_product_attention needs; attention layers "
        "(MultiHeadAttention, GroupedQueryAttention, KerasHub's) compute in "
        "float32 here, their projections in float16. On a GPU they compute "
        "in float16.",
        stacklevel=3,
    )


def _tree(model):
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
        children = layer._flatten_layers(include_self=False, recursive=False)
        stack.extend((child, layer) for child in reversed(list(children)))
    return order


def _is_graph(layer):
    """Sequential and functional models: Keras casts each layer's inputs."""
    return isinstance(layer, (keras.Sequential, Functional))


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
      EinsumDense, convolutions, attention, recurrent cells) and the layers
      inside them but for the deny-list; float32 variables.
    - `"O2"`: half compute everywhere except the deny-list (`DENY_LIST`:
      normalisations, also any class named `...Norm`/`...Normalization`,
      and Softmax) and the model's output layers; float32 variables (master
      weights). In float16, a layer defined outside Keras and KerasHub that
      contains other layers runs its own arithmetic in float32 (the layers
      inside it compute in half), unless it is in `allow`.
    - `"O3"`: half compute and half variables everywhere; BatchNorm too unless
      `keep_batchnorm_fp32=True`. A built model's weights are converted in
      place (same model, same variable objects, values rounded to half).

    The model's output layers compute in float32 at every level, so outputs
    and the loss are float32. Inside a layer that calls other layers, a
    sublayer whose compute dtype differs from its caller's returns its
    outputs in the caller's dtype, so the caller's own arithmetic sees one
    dtype. `keras.layers.Normalization` and the categorical preprocessing
    layers (`Hashing`, `StringLookup`, `CategoryEncoding`, ...) stay float32
    at every level; quantized policies, and policies that compute in a
    dtype other than a float (int64 hash bins, strings), are kept.

    Args:
        model: a Keras model (Sequential, functional or subclassed) or layer,
            built or not.
        level: one of `"O0"`, `"O1"`, `"O2"`, `"O3"`.
        dtype: the half dtype, `"float16"` or `"bfloat16"`.
        keep_batchnorm_fp32: bool or `None` (float32 BatchNorm except at O3).
        allow: layer classes, names or layers to add to the allow-list
            (O1), or, at O2, your own composite layers to run in half.
        deny: layer classes, names or layers to add to the deny-list (O2).

    Returns:
        `model`, changed in place.

    Raises:
        TypeError: `model` is not a Keras layer, or `allow`/`deny` hold
            something other than layer classes, names and layers.
        ValueError: unknown `level` or `dtype`.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.BatchNormalization(),
    ...                           keras.layers.Dense(2)])
    >>> _ = keras_mp.apply_amp(model, "O2")
    >>> [l.dtype_policy.name for l in model.layers]
    ['mixed_float16', 'float32', 'float32']
    """
    check_model(model)
    level_spec = get_level(level)
    half = check_half_dtype(dtype)
    if keep_batchnorm_fp32 is None:
        keep_batchnorm_fp32 = level_spec.keep_batchnorm_fp32_default
    if not isinstance(keep_batchnorm_fp32, bool):
        raise TypeError(
            "`keep_batchnorm_fp32` must be True, False or None. "
            f"Received: keep_batchnorm_fp32={keep_batchnorm_fp32!r}"
        )
    user_allow = check_layer_list(allow, "allow")
    allow = ALLOW_LIST + user_allow
    user_deny = check_layer_list(deny, "deny")
    deny = DENY_LIST + user_deny
    outputs = _output_layers(model)
    entry_dtype = {"all": half, "deny": half}.get(level_spec.half_compute, "float32")
    if (
        half == "float16"
        and level_spec.half_compute == "deny"
        and _runs_unknown_arithmetic(model)
        and not _matches(model, user_allow)
    ):
        entry_dtype = "float32"  # a subclassed model's own `call`, as above
    decisions = []
    inside_allowed = set()  # ids of layers inside an allow-listed one (O1)
    for layer, parent in _tree(model):
        if parent is not None and (
            id(parent) in inside_allowed or (not _is_container(parent) and _matches(parent, allow))
        ):
            inside_allowed.add(id(layer))
        kept = _kept_rule(layer)
        if kept is not None:
            policy, rule = None, kept
        elif _is_subclassed(layer) and (layer is model or any(layer is o for o in outputs)):
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
                layer,
                level_spec,
                half,
                keep_batchnorm_fp32,
                allow,
                deny,
                outputs,
                id(layer) in inside_allowed,
                parent,
            )
        decisions.append((layer, (policy, rule)))
    _set_policies(model, decisions)
    _set_boundaries(model, outputs, entry_dtype)
    _mark_amp_model(model)
    object.__setattr__(model, _LAYER_LISTS_ATTRIBUTE, (user_allow, user_deny))
    return model


def layer_lists(model):
    """The `allow` and `deny` entries the latest `apply_amp` of `model` was
    given (empty tuples when none): `compile(amp_level=...)` applies its
    level with them, so that a layer you denied stays float32."""
    return getattr(model, _LAYER_LISTS_ATTRIBUTE, ((), ()))


def precision_record(model):
    """Each layer's precision as keras_mp set it, for the compile config.

    One entry per layer of `layers_in_order(model)`: its class name, policy,
    rule, boundary casts, and whether the latest `apply_amp`'s `allow` or
    `deny` matched it. `restore_precision` gives a loaded model these back
    by position (layer names are no key: those Keras's counters made differ
    in the process that loads the model), whatever set them: the level,
    `allow`/`deny`, or a `to_float` after `compile`.
    """
    allow, deny = layer_lists(model)
    record = []
    for layer in layers_in_order(model):
        entry = {"class": type(layer).__name__, "policy": layer.dtype_policy.name}
        rule = getattr(layer, _RULE_ATTRIBUTE, None)
        if rule is not None:
            entry["rule"] = rule
        if getattr(layer, _CASTS_ATTRIBUTE, False):
            entry["casts"] = [
                getattr(layer, _ENTRY_DTYPE_ATTRIBUTE),
                getattr(layer, _OUTPUT_DTYPE_ATTRIBUTE),
            ]
        if _matches(layer, allow):
            entry["allow"] = True
        if _matches(layer, deny):
            entry["deny"] = True
        record.append(entry)
    return record


def restore_precision(model, record):
    """Gives `model` the precision `precision_record` saved, layer by layer.

    Returns False, changing nothing, when the record is of a model with
    other layers (its classes in order differ).
    """
    layers = layers_in_order(model)
    if [e.get("class") for e in record] != [type(layer).__name__ for layer in layers]:
        return False
    decisions = []
    for layer, entry in zip(layers, record):
        policy = entry["policy"]
        if _kept_rule(layer) is not None or policy == layer.dtype_policy.name:
            policy = None
        rule = entry.get("rule", getattr(layer, _RULE_ATTRIBUTE, _KERAS_DEFAULT_RULE))
        decisions.append((layer, (policy, rule)))
    _set_policies(model, decisions)
    for layer, entry in zip(layers, record):
        _set_boundary_casts(layer, *(entry.get("casts") or (None, None)))
    _mark_amp_model(model)
    lists = tuple(
        tuple(layer for layer, entry in zip(layers, record) if entry.get(key))
        for key in ("allow", "deny")
    )
    object.__setattr__(model, _LAYER_LISTS_ATTRIBUTE, lists)
    return True


def _set_boundaries(model, outputs=None, entry_dtype=None):
    """The boundary rule: what a layer returns to the layer that calls it.

    `outputs` None (`to_float` on a layer): only the layers inside `model`
    are set; `model`'s own casts are left as they are.

    - A subclassed model that is the model (or one of its outputs) takes
      float32 inputs, computes inside in the level's `entry_dtype`, and
      returns float32.
    - Inside a layer that runs its own `call` (a composite layer such as
      `TransformerEncoder`, or a subclassed model), a sublayer whose compute
      dtype differs from its caller's returns its floating outputs in the
      caller's dtype: a float32 LayerNormalization inside a float16 block
      (O2) returns float16, a float16 Dense inside a float32 block (O1)
      returns float32. The caller's own arithmetic (`x + residual`) then
      sees one dtype, as it does under one Keras mixed policy.
    - Inside Sequential and functional models nothing is cast on the way
      out: Keras casts each layer's inputs to its own compute dtype.
    """
    inner_dtypes = {}
    for layer, parent in _tree(model):
        if outputs is None and layer is model:
            inner_dtypes[id(layer)] = None if _is_graph(layer) else layer.compute_dtype
            continue
        if _is_subclassed(layer) and (layer is model or any(layer is o for o in outputs or ())):
            inner_dtypes[id(layer)] = entry_dtype
            _set_boundary_casts(layer, entry_dtype, "float32")
            continue
        inner_dtypes[id(layer)] = None if _is_graph(layer) else layer.compute_dtype
        caller_dtype = None if parent is None else inner_dtypes[id(parent)]
        # A model held by the (subclassed) model: its own `train_step` or
        # `compute_loss` calls it too, and gets float32, as from the model.
        held = parent is model and _is_subclassed(model) and _is_container(layer)
        object.__setattr__(layer, _OUTSIDE_DTYPE_ATTRIBUTE, "float32" if held else None)
        if caller_dtype is not None and (
            layer.compute_dtype != caller_dtype or _is_container(layer)
        ):
            _set_boundary_casts(layer, output_dtype=caller_dtype)
            rule = getattr(layer, _RULE_ATTRIBUTE, None)
            if rule is not None and layer.compute_dtype != caller_dtype:
                object.__setattr__(
                    layer, _RULE_ATTRIBUTE, f"{rule}; returns {caller_dtype} to {parent.name}"
                )
        else:
            _set_boundary_casts(layer)


def to_float(layer_or_model, dtype):
    """Manual mixed precision: a layer and all its sublayers compute in `dtype`.

    As MindSpore's `Cell.to_float`: `"float16"` or `"bfloat16"` gives the layer
    (and every layer inside it) half compute with float32 variables
    (`mixed_float16` / `mixed_bfloat16`); `"float32"` puts it back in full
    precision. Other layers are untouched. Inside the layer, as with
    `apply_amp`, quantized layers and layers that compute in a dtype other
    than a float keep their policies, and the categorical preprocessing
    layers stay float32.

    Args:
        layer_or_model: a Keras layer or model.
        dtype: `"float16"`, `"bfloat16"` or `"float32"`.

    Returns:
        `layer_or_model`, changed in place.
    """
    check_model(layer_or_model, "layer_or_model")
    name = getattr(dtype, "name", dtype)
    if name not in ("float16", "bfloat16", "float32"):
        raise ValueError(
            f"`dtype` must be one of float16, bfloat16, float32. Received: dtype={dtype!r}"
        )
    policy = "float32" if name == "float32" else f"mixed_{name}"
    rule = f"to_float({name!r})"
    decisions = []
    for layer in layers_in_order(layer_or_model):
        kept = _kept_rule(layer)
        if kept is not None:
            decisions.append((layer, (None, kept)))
        elif isinstance(layer, _EXACT_PREPROCESSING):
            decisions.append((layer, ("float32", f"{rule}: indices, counts and bins in float32")))
        else:
            decisions.append((layer, (policy, rule)))
    _set_policies(layer_or_model, decisions)
    # One dtype inside: no sublayer casts its outputs any more. What the
    # layer itself returns to its caller is left as it was.
    _set_boundaries(layer_or_model)
    _mark_amp_model(layer_or_model)
    return layer_or_model


@dataclasses.dataclass(frozen=True, repr=False)
class PrecisionSummary(table.Report):
    """`precision_summary`'s table (`.text`, or print it) and its `.rows`;
    `.optimizers`: one dict per optimizer the model holds (`optimizer`,
    `class`, `settings`)."""

    optimizers: list = dataclasses.field(default_factory=list)


def precision_summary(model, print_fn=None):
    """A per-layer table: compute dtype, variable dtype, and the rule that set it.

    Args:
        model: a Keras model or layer.
        print_fn: optional callable given the text (e.g. `print`).

    Returns:
        A `PrecisionSummary`: print it for the table (`.text`); `.rows` is
        a list of dicts with keys `layer`, `class`, `compute_dtype`,
        `variable_dtype`, `policy` and `rule`.
    """
    check_model(model)
    rows = []
    for layer in layers_in_order(model):
        policy = layer.dtype_policy
        rule = getattr(layer, _RULE_ATTRIBUTE, _KERAS_DEFAULT_RULE)
        fell_back = fallback.fell_back(layer)
        rows.append(
            {
                "layer": layer.path if getattr(layer, "path", None) else layer.name,
                "class": type(layer).__name__,
                "compute_dtype": "float32" if fell_back else policy.compute_dtype,
                "variable_dtype": policy.variable_dtype,
                "policy": policy.name,
                "rule": f"{rule}; {fell_back}" if fell_back else rule,
            }
        )
    columns = ("layer", "class", "compute_dtype", "variable_dtype", "rule")
    headers = ("Layer", "Class", "Compute", "Variables", "Rule")
    cells = [[str(r[c]) for c in columns] for r in rows]
    lines = table.render(headers, cells, width=None)
    optimizers = _optimizer_rows(model)
    if optimizers:
        lines += [""] + table.render(
            ("Optimizer", "Class", "Settings"),
            [[o["optimizer"], o["class"], o["settings"]] for o in optimizers],
            width=None,
        )
    summary = PrecisionSummary("\n".join(lines), rows, optimizers)
    if print_fn is not None:
        print_fn(summary.text)
    return summary


def _optimizer_rows(model):
    """One row per optimizer the model holds, with what keras_mp gave it."""
    from keras_mp._src import wrapping

    if not isinstance(model, keras.Model):
        return []
    rows = []
    half = wrapping.has_half_variables(model)
    for label, _, optimizer in wrapping.find_optimizers(model):
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and hasattr(
            optimizer, "config"
        ):
            inner = type(optimizer.inner_optimizer).__name__
            settings = wrapping.describe(optimizer, half)
            name = f"LossScaleOptimizer({inner})"
        else:
            name = type(optimizer).__name__
            settings = "as given (no keras_mp loss scale, skip or master weights)"
        rows.append({"optimizer": label, "class": name, "settings": settings})
    return rows


def layers_in_order(model):
    """The model and its layers, each once, depth first in the order they
    were added (Keras's recursive `_flatten_layers` lists a nested model's
    layers last to first)."""
    seen, ordered, stack = set(), [], [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        ordered.append(layer)
        stack.extend(reversed(list(layer._flatten_layers(include_self=False, recursive=False))))
    return ordered


def _is_container(layer):
    return isinstance(layer, keras.Model)


def _set_policy(layer, policy_name, rule):
    """Sets the policy; returns whether a built layer's variables changed.

    `policy_name` None keeps the layer's policy (`_kept_rule`).
    """
    object.__setattr__(layer, _RULE_ATTRIBUTE, rule)
    if policy_name is None:
        return False
    _keep_config_loadable(layer)
    policy = keras.dtype_policies.get(policy_name)
    previous = layer.dtype_policy.variable_dtype
    layer.dtype_policy = policy
    if not _is_container(layer) and not _from_aware_package(layer):
        fallback.watch(layer)  # your own layer: float32 if its call cannot run in half
    return layer.built and _convert_own_variables(layer, previous, policy.variable_dtype)


def _keep_config_loadable(layer):
    """Makes a block of the user's that computes in half rebuild from its config.

    A layer written as Keras's guides write one makes its sublayers in
    `__init__` without passing its dtype on, and its config does not hold
    them: rebuilt from its config (`load_model`, `clone_model`,
    `serving_copy`), the block gets its saved policy and its sublayers
    Keras's default. Its own arithmetic then mixes half and float32, which
    TensorFlow refuses (Keras's own mixed policies fail the same way in a
    process whose global policy is float32). Such a layer's config gives no
    dtype instead, so that the block comes back in the default policy with
    its sublayers; `compile_from_config` then restores the precision that
    keras_mp set (`restore_precision`). A layer of Keras or KerasHub passes
    its dtype on, and a layer whose config holds its sublayers' configs
    rebuilds them with their own: theirs are left as they are.
    """
    if (
        getattr(layer, _LOADABLE_CONFIG_ATTRIBUTE, False)
        or _is_graph(layer)
        or _from_aware_package(layer)
    ):
        return
    get_config = layer.get_config

    @functools.wraps(get_config)
    def get_config_without_half_dtype():
        config = get_config()
        if (
            isinstance(config, dict)
            and config.get("dtype") is not None
            and layer.dtype_policy.name != keras.config.dtype_policy().name
            and any(True for _ in layer._flatten_layers(include_self=False, recursive=False))
            and not _holds_layer_configs([v for k, v in config.items() if k != "dtype"])
        ):
            config = {**config, "dtype": None}
        return config

    object.__setattr__(layer, "get_config", get_config_without_half_dtype)
    object.__setattr__(layer, _LOADABLE_CONFIG_ATTRIBUTE, True)


def _holds_layer_configs(value):
    """Whether a config value holds a layer, or a serialized one (a config with
    a dtype)."""
    if isinstance(value, keras.layers.Layer):
        return True
    if isinstance(value, dict):
        config = value.get("config")
        if isinstance(config, dict) and "dtype" in config:
            return True
        return any(_holds_layer_configs(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_layer_configs(v) for v in value)
    return False


def _set_policies(model, decisions):
    changed = False
    for layer, (policy_name, rule) in decisions:
        changed = _set_policy(layer, policy_name, rule) or changed
    if changed:
        _retrack_torch_parameters(model)


# Keras creates LoRA weights in float32 whatever the layer's policy ("to
# avoid the risk of underflow or overflow during fine-tuning").
_LORA_WEIGHTS = ("lora_kernel_a", "lora_kernel_b", "lora_embeddings_a", "lora_embeddings_b")


def _convert_own_variables(layer, previous, variable_dtype):
    """Recasts a built layer's own variables of its previous policy's dtype
    in place (same objects), as building it under the new policy would have
    created them: a weight created with a dtype of its own (LoRA's float32,
    a custom layer's `add_weight(dtype=...)`, integer counters) keeps it."""
    if previous == variable_dtype:
        return False
    own_dtype = {
        id(getattr(layer, name)) for name in _LORA_WEIGHTS if getattr(layer, name, None) is not None
    }
    changed = False
    for variable in list(layer._trainable_variables) + list(layer._non_trainable_variables):
        current = keras.backend.standardize_dtype(variable.dtype)
        if current != previous or id(variable) in own_dtype:
            continue
        value = keras.ops.cast(variable.value, variable_dtype)
        variable._dtype = variable_dtype
        variable._initialize(value)
        changed = True
    return changed


def _retrack_torch_parameters(model):
    """PyTorch modules register parameters by object, in every ancestor.

    Every torch module under the model, not only its Keras layers: a
    Sequential keeps its parameters in a functional model of its own
    (`_functional`), which Keras's layer walk does not visit. Left stale,
    `zero_grad()` (which Keras's and the guides' PyTorch steps call) would
    clear the old parameters' gradients, and the new ones' would add up
    from step to step.
    """
    if not hasattr(model, "modules"):  # not a torch module: another backend
        return
    for module in model.modules():
        if hasattr(module, "_torch_params") and hasattr(module, "_track_variables"):
            module._track_variables()
