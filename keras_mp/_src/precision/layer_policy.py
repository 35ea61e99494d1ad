"""Setting a layer's dtype policy: the rule that decided it noted beside it
(for `precision_summary`), a built layer's variables recast in place to the
new policy's variable dtype, Keras's float8 policy quantizing a built layer.
"""

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision import conditions
from keras_mp._src.precision import fallback
from keras_mp._src.precision import float8
from keras_mp._src.precision import layer_kinds
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.loadable_config import keep_config_loadable

_RULE_ATTRIBUTE = "_keras_mp_rule"
# The rule of a layer keras_mp never set.
KERAS_DEFAULT_RULE = "Keras default"


def rule_of(layer, default=KERAS_DEFAULT_RULE):
    """The rule that set `layer`'s policy (`default` if none did)."""
    return getattr(layer, _RULE_ATTRIBUTE, default)


def note_rule(layer, rule):
    """Notes `rule` as what set `layer`'s policy (its summary's line)."""
    object.__setattr__(layer, _RULE_ATTRIBUTE, rule)


def set_policies(model, decisions):
    """Sets each `(layer, (policy name or None, rule))`; None keeps the
    layer's policy. A built layer's variables are converted in place."""
    changed = False
    for layer, (policy_name, rule) in decisions:
        changed = _set_policy(layer, policy_name, rule) or changed
        if float8.is_float8(layer):
            float8.set_call(layer, conditions.frozen(layer, None))
    if changed:
        backends.current.variables_changed(model)


def _set_policy(layer, policy_name, rule):
    """Sets the policy; returns whether a built layer's variables changed.

    `policy_name` None keeps the layer's policy (`rules.KEEP`).
    """
    note_rule(layer, rule)
    if policy_name is None:
        return False
    keep_config_loadable(layer)
    policy = keras.dtype_policies.get(policy_name)
    previous = layer.dtype_policy.variable_dtype
    quantizes = policy.quantization_mode is not None and layer.built
    if quantizes:
        # Keras's float8 policy quantizes a built layer when set (its scales
        # and amax histories): its variables take the dtype first.
        layer.dtype_policy = float8.source_of(policy)
    else:
        layer.dtype_policy = policy
    if not layer_tree.is_container(layer) and layer_kinds.runs_users_code(layer):
        fallback.watch(layer)  # your code: float32 if its call cannot run in half
    changed = layer.built and _convert_own_variables(layer, previous, policy.variable_dtype)
    if quantizes:
        layer.dtype_policy = policy
        if float8.is_float8(layer):
            float8.start_scales_from_weights(layer)
    return changed or quantizes


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
    for variable in keras_internals.own_variables(layer):
        current = keras.backend.standardize_dtype(variable.dtype)
        if current != previous or id(variable) in own_dtype:
            continue
        keras_internals.recast(variable, variable_dtype)
        changed = True
    return changed


_FLOAT8_RECIPE_ATTRIBUTE = "_keras_mp_float8_recipe"


def note_float8_recipe(model, recipe):
    """Notes the `Float8Recipe` the model's precision was set with (None:
    not at `amp_dtype="float8"`), for loading FP8 weights (`to_float8`)."""
    object.__setattr__(model, _FLOAT8_RECIPE_ATTRIBUTE, recipe)


def to_float8(model, names):
    """Puts in FP8 the layers of `model` named in `names` that FP8's rules
    kept in bfloat16 (the size rule, the first and output layers) while the
    model is at `amp_dtype="float8"`: weights saved from them in FP8 (3
    scales and 3 amax histories beside kernel and bias) load as FP8, as a
    `.keras` file's do. Returns the layers changed (none where the model is
    not at float8)."""
    recipe = getattr(model, _FLOAT8_RECIPE_ATTRIBUTE, None)
    if recipe is None:
        return []
    changed = [
        layer
        for layer, _ in layer_tree.tree(model)
        if layer.name in names
        and float8.has_float8_path(layer)
        and not float8.is_float8(layer)
        and layer.dtype_policy.compute_dtype == "bfloat16"
        and " float8: " in rule_of(layer)
    ]
    for layer in changed:
        level = rule_of(layer).split(" float8: ")[0]
        rule = f"{level} float8: FP8 in the weights loaded, kept in FP8"
        _set_policy(layer, float8.policy(layer.dtype_policy.name, recipe), rule)
        float8.set_call(layer, conditions.frozen(layer, None))
    if changed:
        backends.current.variables_changed(model)
    return changed
