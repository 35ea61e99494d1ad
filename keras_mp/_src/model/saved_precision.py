"""Each layer's precision, saved with the model and given back at load.

`compile(amp_level=...)` records every layer's policy, rule and boundary
casts in the compile config (`AMP_LAYERS`), so that a `.keras` file, a
`load_model` and a `compile_from_config` give back the precision keras_mp
set (the level, `allow`/`deny`, a later `to_float`), also for models whose
`compile` is their own (KerasHub's tasks). The same record rides in the
model's own config too (`config_precision.py`), for the roads that do not
compile the model; files of earlier releases carry it here only. The Keras
`Trainer` methods extended here are installed by `compile.install`.
"""

import functools
import inspect
import json
import warnings

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import boundaries
from keras_mp._src.precision import layer_policy
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import policies
from keras_mp._src.precision import probabilities
from keras_mp._src.precision import rules
from keras_mp._src.precision.layer_kinds import matches
from keras_mp._src.precision.loadable_config import keep_config_loadable
from keras_mp._src.precision.loadable_config import mark_policies

# The compile config's keys of the amp settings, and of each layer's record.
AMP_ARGUMENTS = (
    "amp_level",
    "amp_dtype",
    "loss_scale",
    "keep_batchnorm_fp32",
    "master_weights",
    "float8_recipe",
)
AMP_LAYERS = "amp_layers"
# A loaded model's record, until its compile restores it (`restore_saved`).
_SAVED_PRECISION = "_keras_mp_saved_precision"

Trainer = keras_internals.Trainer
keras_model_from_config = keras_internals.saving_lib._model_from_config
keras_compile_from_config = Trainer.compile_from_config
keras_get_compile_config = Trainer.get_compile_config


def precision_record(model):
    """Each layer's precision as keras_mp set it, for the compile config and
    the model's own (`config_precision.py`).

    One entry per layer of `layers_in_order(model)`: its class name, policy,
    rule, boundary casts (and the dtype it returns outside its subclassed
    model's `call`), and whether the latest `apply_amp`'s `allow` or `deny`
    matched it. `restore_precision` gives a loaded model these back
    by position (layer names are no key: those Keras's counters made differ
    in the process that loads the model), whatever set them: the level,
    `allow`/`deny`, or a `to_float` after `compile`.
    """
    allow, deny = policies.layer_lists(model)
    record = []
    for layer in layer_tree.layers_in_order(model):
        entry = {"class": type(layer).__name__, "policy": layer.dtype_policy.name}
        length = getattr(layer.dtype_policy, "amax_history_length", None)
        if length is not None:  # Keras's float8 policy: its recipe too
            entry["amax_history_length"] = length
        rule = layer_policy.rule_of(layer)
        if rule != layer_policy.KERAS_DEFAULT_RULE:
            entry["rule"] = rule
        casts = boundaries.casts_of(layer)
        if casts is not None:
            entry["casts"] = list(casts)
        outside = boundaries.outside_dtype_of(layer)
        if outside is not None:
            entry["outside"] = outside
        if matches(layer, allow):
            entry["allow"] = True
        if matches(layer, deny):
            entry["deny"] = True
        record.append(entry)
    return record


def restore_precision(model, record):
    """Gives `model` the precision `precision_record` saved, layer by layer.

    Returns False, changing nothing, when the record is of a model with
    other layers (its classes in order differ).
    """
    layers = layer_tree.layers_in_order(model)
    if [e.get("class") for e in record] != [type(layer).__name__ for layer in layers]:
        return False
    decisions = []
    for layer, entry in zip(layers, record):
        policy = entry["policy"]
        if rules.kept_reason(layer) is not None:
            policy = None
        elif policy == layer.dtype_policy.name:
            if "rule" in entry:
                # Kept as its config rebuilt it, a policy keras_mp set all the
                # same: a KerasHub model at O1 (the policy it was built under)
                # must still write the record in its config.
                keep_config_loadable(layer)
            policy = None
        elif "amax_history_length" in entry:
            policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
                "float8",
                policy.split("_from_", 1)[1],
                amax_history_length=entry["amax_history_length"],
            )
        rule = entry.get("rule", layer_policy.rule_of(layer))
        decisions.append((layer, (policy, rule)))
    layer_policy.set_policies(model, decisions)
    probabilities.set_probabilities(layers)
    for layer, entry in zip(layers, record):
        boundaries.set_boundary_casts(layer, *(entry.get("casts") or (None, None)))
        boundaries.set_outside_dtype(layer, entry.get("outside"))
    boundaries.set_probability_ops(model)
    mark_policies(layers, policies.needs_keras_mp)
    policies.mark_amp_model(model)
    policies.set_layer_lists(
        model,
        *(
            tuple(layer for layer, entry in zip(layers, record) if entry.get(key))
            for key in ("allow", "deny")
        ),
    )
    return True


@functools.wraps(keras_get_compile_config)
def get_compile_config_with_precision(self):
    """Keras's compile config; for a model whose precision keras_mp set, with
    each layer's (`precision_record`), as it is when the config is taken:
    a `to_float` after `compile` is saved too."""
    config = keras_get_compile_config(self)
    if config and policies.is_amp_model(self):
        config = {**config, AMP_LAYERS: precision_record(self)}
    return config


def restore_saved(model):
    """Gives a loaded model the precision its compile config recorded, once:
    after its level is applied and before its optimizer is built."""
    record = model.__dict__.pop(_SAVED_PRECISION, None)
    if record is not None and not restore_precision(model, record):
        warnings.warn(
            f"keras_mp: the per-layer precision saved in the compile config "
            f"does not match model {model.name!r} ({len(record)} layers "
            f"saved; its layers differ in number or class), so it was not "
            f"applied; the model has its level's precision instead.",
            stacklevel=3,
        )


@functools.wraps(keras_compile_from_config)
def compile_from_config_with_amp(self, config):
    """`load_model`'s recompile; the precision and the optimizer come back.

    Keras does not call a `compile` that a model class overrides (KerasHub's
    task models do) when it loads the model, so their amp settings would be
    dropped with it and the model would come back computing in whatever its
    layers' configs say. The saved level is applied here first: the policies,
    the boundary casts and O3's half variables are restored before the
    weights are loaded. A model whose `compile` is Keras's is then compiled
    with its amp settings, as before; so is one whose own `compile` takes
    every saved argument (KerasHub's tasks pass them on to Keras's), or its
    optimizer, the loss scale with it, would not be loaded: the model would
    resume with the optimizer its constructor made, from scale 2**15.

    Each layer's own precision, as saved (`AMP_LAYERS`), is then given back
    by the compile, after the level and before the optimizer is built (or
    here, where no compile runs): what `allow`/`deny` and `to_float` chose,
    and the layers a block of the user's makes, which its config does not
    hold.
    """
    if not isinstance(config, dict):
        return keras_compile_from_config(self, config)
    config = dict(config)
    record = config.pop(AMP_LAYERS, None)
    if record is not None:
        object.__setattr__(self, _SAVED_PRECISION, record)
    try:
        amp = {k: config.get(k) for k in AMP_ARGUMENTS}
        if amp["amp_level"] is not None:
            policies.apply_amp(
                self,
                amp["amp_level"],
                amp["amp_dtype"] or "float16",
                keep_batchnorm_fp32=amp["keep_batchnorm_fp32"],
                float8_recipe=amp["float8_recipe"],
            )
            if type(self).compile is not Trainer.compile and _takes(self.compile, config):
                self.compile(**keras.saving.deserialize_keras_object(config))
                if self.built and getattr(self, "optimizer", None) is not None:
                    self.optimizer.build(self.trainable_variables)  # as Keras's does
                return None
        return keras_compile_from_config(self, config)
    finally:
        restore_saved(self)  # a model that Keras left uncompiled


def _takes(method, config):
    """Whether `method` accepts `config`'s items as keyword arguments."""
    try:
        inspect.signature(method).bind(**config)
    except TypeError:
        return False
    return True


@functools.wraps(keras_model_from_config)
def model_from_config_with_precision(config_json, custom_objects, compile, safe_mode):
    """`load_model`'s model from a `.keras` file's config; with
    `compile=False` (no `compile_from_config`), the precision its compile
    config recorded is given back too: the file computes what the model
    computed when it was saved."""
    model = keras_model_from_config(config_json, custom_objects, compile, safe_mode)
    if not compile and isinstance(model, keras.Model):
        try:
            compile_config = json.loads(config_json).get("compile_config") or {}
        except (TypeError, ValueError):
            compile_config = {}
        record = compile_config.get("config", compile_config).get(AMP_LAYERS)
        if record is not None:
            object.__setattr__(model, _SAVED_PRECISION, record)
            restore_saved(model)
    return model
