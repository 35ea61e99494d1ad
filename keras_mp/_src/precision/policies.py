"""Per-layer dtype policies: a level applied to a model, by hand or by list.

Every decision is an ordinary Keras dtype policy on `layer.dtype_policy`; the
rule that set it (`rules.py`) is kept beside it, for `precision_summary`.
`apply_amp` walks the layer tree once, asks the rules for each layer, sets
the policies (converting a built model's variables at O3), then the
boundary casts (`boundaries.py`).
"""

import keras

from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import boundaries
from keras_mp._src.precision import float8
from keras_mp._src.precision import head_returns
from keras_mp._src.precision import layer_kinds
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import named_layers
from keras_mp._src.precision import output_heads
from keras_mp._src.precision import probabilities
from keras_mp._src.precision import rules
from keras_mp._src.precision.layer_kinds import ALLOW_LIST
from keras_mp._src.precision.layer_kinds import EXACT_PREPROCESSING
from keras_mp._src.precision.layer_kinds import matches
from keras_mp._src.precision.layer_policy import note_float8_recipe
from keras_mp._src.precision.layer_policy import note_rule
from keras_mp._src.precision.layer_policy import rule_of
from keras_mp._src.precision.layer_policy import set_policies
from keras_mp._src.precision.loadable_config import mark_policies

# Set on a model that `apply_amp` or `to_float` was given (see `is_amp_model`).
_AMP_MODEL_ATTRIBUTE = "_keras_mp_amp_model"
_LAYER_LISTS_ATTRIBUTE = "_keras_mp_layer_lists"
# What `amp_level="auto"` picked for the model and why (`AmpSettings.auto`).
_AUTO_ATTRIBUTE = "_keras_mp_auto"


def mark_amp_model(model):
    if isinstance(model, keras.Model):
        object.__setattr__(model, _AMP_MODEL_ATTRIBUTE, True)


def is_amp_model(model):
    """Whether keras_mp set this model's precision (`apply_amp`, `to_float`,
    `compile(amp_level=...)`): what keras_mp changes of Keras's behaviour
    beyond the policies applies to such models only."""
    return getattr(model, _AMP_MODEL_ATTRIBUTE, False)


def check_model(model, argument="model"):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"`{argument}` must be a Keras model or layer (a "
            f"`keras.layers.Layer`). Received: {argument}={model!r} of type "
            f"{type(model).__name__}"
        )


def apply_amp(
    model,
    level="O2",
    dtype="float16",
    keep_batchnorm_fp32=None,
    allow=None,
    deny=None,
    float8_recipe=None,
):
    """Sets every layer's dtype policy for a precision level.

    The levels (Apex's O0-O3, MindSpore's `amp_level`):

    - `"O0"`: float32 everywhere (the accuracy baseline).
    - `"O1"`: half compute on the allow-list only (`ALLOW_LIST`: Dense,
      EinsumDense, convolutions, attention, recurrent cells) and the layers
      inside them but for the deny-list; float32 variables.
    - `"O2"`: half compute everywhere except the deny-list (`DENY_LIST`:
      normalisations, also any class named `...Norm`/`...Normalization`,
      and Softmax); float32 variables (master weights). In float16, a
      layer defined outside Keras and KerasHub that contains other layers
      runs its own arithmetic in float32 (the layers inside it compute in
      half), unless it is in `allow`.
    - `"O3"`: half compute and half variables everywhere; BatchNorm too unless
      `keep_batchnorm_fp32=True`. A built model's weights are converted in
      place (same model, same variable objects, values rounded to half).

    The model's output layers compute as the level says and return float32,
    so outputs and the loss are float32: a head's matmul (a language model's
    largest) runs in half, unless float16 could overflow its outputs (a
    regression loss, or a loss keras_mp does not know, on an output without
    a bounded activation: float32 there; `output_losses.py`). Softmax,
    log_softmax and sigmoid run in float32 wherever they sit (a layer's
    activation, a `Softmax` or `Activation` layer), and layers that only
    move values (`Reshape`, `Flatten`) pass on the dtype they receive.
    Inside a layer that calls other layers, a sublayer whose compute dtype
    differs from its caller's returns its outputs in the caller's dtype, so
    the caller's own arithmetic sees one dtype. `keras.layers.Normalization`
    and the categorical preprocessing layers (`Hashing`, `StringLookup`,
    `CategoryEncoding`, ...) stay float32 at every level; quantized
    policies, and policies that compute in a dtype other than a float (int64
    hash bins, strings), are kept.

    Args:
        model: a Keras model (Sequential, functional or subclassed) or layer,
            built or not.
        level: one of `"O0"`, `"O1"`, `"O2"`, `"O3"`.
        dtype: the half dtype, `"float16"` or `"bfloat16"`; or `"float8"`
            (O2, O3): the Dense and EinsumDense layers whose GEMM dimensions
            are multiples of 16, but for the first and the output layers,
            compute their matmuls in FP8 through Keras's float8 path (E4M3
            forward, E5M2 gradients, delayed per-tensor scaling), every
            other layer as at the level in bfloat16.
        keep_batchnorm_fp32: bool or `None` (float32 BatchNorm except at O3).
        allow: layer classes, names or layers to add to the allow-list
            (O1), or, at O2, your own composite layers to run in half. A
            string is a layer's name (never a class's: pass the class), and
            must name a layer of the model's tree, nested models included.
        deny: layer classes, names or layers to add to the deny-list (O2);
            names as for `allow`.
        float8_recipe: with `dtype="float8"`: a `keras_mp.Float8Recipe`
            (or a dict of its arguments); None: its defaults.

    Returns:
        `model`, changed in place.

    Raises:
        TypeError: `model` is not a Keras layer, or `allow`/`deny` hold
            something other than layer classes, names and layers.
        ValueError: unknown `level` or `dtype`; a name in `allow`/`deny`
            that names no layer of the model (the error gives the nearest).

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.BatchNormalization(),
    ...                           keras.layers.Dense(2)])
    >>> _ = keras_mp.apply_amp(model, "O2")
    >>> [l.dtype_policy.name for l in model.layers]
    ['mixed_float16', 'float32', 'float32']
    """
    check_model(model)
    return apply(
        model,
        amp_settings.for_layers(level, dtype, keep_batchnorm_fp32, allow, deny, float8_recipe),
    )


def apply(model, amp, set_before=None):
    """`apply_amp` with its settings resolved (`amp_settings.AmpSettings`).
    `set_before`: `{id(layer): (policy name, rule)}` an earlier `apply` set;
    a layer whose policy or rule changed since was set by hand, and keeps it."""
    if model.built or not layer_tree.is_subclassed(model):
        # A subclassed model's `build` may create the layers named: it is
        # applied again once built (`when_built`), and checked then.
        named_layers.check_names(model, amp)
    object.__setattr__(model, _AUTO_ATTRIBUTE, amp.auto)
    outputs = layer_tree.output_layers(model)
    entry_dtype = amp.inner_dtype
    if rules.own_arithmetic_in_float32(model, rules.Place(amp, model)):
        entry_dtype = "float32"  # a subclassed model's own `call`, as its layers'
    heads = output_heads.find(model, _loss(model, amp))
    decisions = decide_all(model, amp, outputs, heads)
    by_hand = {id(layer) for layer, _ in decisions if _set_by_hand(layer, set_before)}
    decisions = [(x, (None, rule_of(x)) if id(x) in by_hand else d) for x, d in decisions]
    float8.refuse_lora([layer for layer, _ in decisions])
    set_policies(model, decisions)
    layers = [layer for layer, _ in decisions]
    probabilities.set_probabilities(layers)
    returns, own_float32 = head_returns.set_boundaries(model, amp, heads, outputs, entry_dtype)
    _annotate_returns(
        [r for r in returns if id(r[0]) not in by_hand], [x for x in layers if id(x) not in by_hand]
    )
    for caller, note in own_float32:
        note_rule(caller, f"{rule_of(caller)}; {note}")
    mark_policies(layers, needs_keras_mp)
    if amp.float8 is not None:
        float8.warn_once_where_nothing_computes_fp8()
    mark_amp_model(model)
    note_float8_recipe(model, amp.float8)
    set_layer_lists(model, amp.allow, amp.deny)
    if (heads.deferred or _sizes_unknown(layers, amp)) and not model.built:
        # Its outputs, and its layers' GEMM sizes (FP8's size rule), are
        # known once it is built (`compile`, then `fit`).
        set_now = {id(layer): (layer.dtype_policy.name, rule_of(layer)) for layer in layers}
        output_heads.when_built(model, lambda: apply(model, amp, set_now))
    return model


def _sizes_unknown(layers, amp):
    return amp.float8 is not None and any(
        float8.has_float8_path(layer) and float8.size_unknown(layer, amp.float8) for layer in layers
    )


def _set_by_hand(layer, set_before):
    now = (layer.dtype_policy.name, rule_of(layer))
    return set_before is not None and set_before.get(id(layer), now) != now


def _loss(model, amp):
    """The loss `compile` was given, or the one a compiled model has."""
    return amp.loss if amp.loss is not None else getattr(model, "loss", None)


def decide_all(model, amp, outputs=None, heads=None):
    """`[(layer, (policy name or None, reason))]` for `model`'s tree under
    `amp`: what `apply` sets, computed without setting it (the speed report
    asks it of a level the model is not at). `heads`: `output_heads.find`'s."""
    if outputs is None:
        outputs = layer_tree.output_layers(model)
    if heads is None:
        heads = output_heads.find(model, _loss(model, amp))
    decisions = []
    inside_allowed = set()  # ids of layers inside an allow-listed one (O1)
    inside_denied = set()  # ids of layers inside a nested model named in `deny=`
    first = float8.first_layers(model) if amp.float8 is not None else set()
    allow = ALLOW_LIST + amp.allow
    for layer, parent in layer_tree.tree(model):
        if parent is not None and (
            id(parent) in inside_allowed
            or (not layer_tree.is_container(parent) and matches(parent, allow))
        ):
            inside_allowed.add(id(layer))
        if parent is not None and (
            id(parent) in inside_denied
            or (layer_tree.is_container(parent) and matches(parent, amp.deny))
        ):
            inside_denied.add(id(layer))
        place = rules.Place(
            amp,
            model,
            parent,
            output=any(layer is o for o in outputs),
            inside_allowed=id(layer) in inside_allowed,
            inside_denied=id(layer) in inside_denied,
            first=id(layer) in first,
            head=heads.head(layer),
            loss=heads.loss(layer),
        )
        decisions.append((layer, rules.decide(layer, place)))
    return decisions


def _annotate_returns(returns, layers):
    """Adds to each layer's rule what it returns to its caller, and the
    probability activation it computes in float32."""
    for layer, dtype, caller in returns:
        rule = rule_of(layer, None)
        if rule is None:
            continue
        if caller is None:  # a model output
            rule = f"{rule}; model output: returns {dtype}"
            half = boundaries.reads_weights_in_float32(layer)
            if half is not None:
                rule = (
                    f"{rule}; its weights read in float32 on this CPU (no native "
                    f"{half} matmul): its matmul in float32"
                )
        elif layer_tree.is_graph(caller):
            rule = f"{rule}; returns {dtype} to its {dtype} consumers in {caller.name}"
        else:
            rule = f"{rule}; returns {dtype} to {caller.name}"
        if boundaries.keeps_half_output(layer):
            rule = f"{rule} (kept in {dtype} for the backward pass)"
        note_rule(layer, rule)
    for layer in layers:
        rule = rule_of(layer, None)
        if rule is not None and probabilities.computes_in_float32(layer):
            activation = layer_kinds.probability_activation(layer)
            note_rule(layer, f"{rule}; {activation} in float32")


def needs_keras_mp(layer):
    """Whether `layer` computes other than its policy alone says: casts at
    its boundary, probabilities in float32, inputs passed on uncast
    (`loadable_config.mark_policies`)."""
    casts = boundaries.casts_of(layer)
    if casts is not None and any(cast is not None for cast in casts):
        return True
    if probabilities.computes_in_float32(layer):
        return True
    half = keras.backend.standardize_dtype(layer.compute_dtype) != "float32"
    return half and isinstance(layer, layer_kinds.DATA_MOVEMENT)


def auto_choice(model):
    """What `amp_level="auto"` picked for `model` and why, or None (the
    model's latest level was named)."""
    return getattr(model, _AUTO_ATTRIBUTE, None)


def layer_lists(model):
    """The `allow` and `deny` entries the latest `apply_amp` of `model` was
    given (empty tuples when none): `compile(amp_level=...)` applies its
    level with them, so that a layer you denied stays float32."""
    return getattr(model, _LAYER_LISTS_ATTRIBUTE, ((), ()))


def set_layer_lists(model, allow, deny):
    object.__setattr__(model, _LAYER_LISTS_ATTRIBUTE, (tuple(allow), tuple(deny)))


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
    for layer in layer_tree.layers_in_order(layer_or_model):
        kept = rules.kept_reason(layer)
        if kept is not None:
            decisions.append((layer, (None, kept)))
        elif isinstance(layer, EXACT_PREPROCESSING):
            decisions.append((layer, ("float32", f"{rule}: indices, counts and bins in float32")))
        else:
            decisions.append((layer, (policy, rule)))
    set_policies(layer_or_model, decisions)
    probabilities.set_probabilities(layer for layer, _ in decisions)
    # One dtype inside: no sublayer casts its outputs any more. What the
    # layer itself returns to its caller is left as it was.
    boundaries.set_boundaries(layer_or_model)
    mark_policies([layer for layer, _ in decisions], needs_keras_mp)
    mark_amp_model(layer_or_model)
    return layer_or_model
