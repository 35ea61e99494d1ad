"""Configs that rebuild in the precision keras_mp set, or refuse to rebuild
without keras_mp.

`apply_amp` gives this to each layer it sets a policy on
(`keep_config_loadable`); it changes a layer's `get_config` only for a
block of the user's written as Keras's guides write one.

A layer that computes other than its policy alone says (its outputs cast
to float32 or to its caller's dtype, its probabilities in float32, its
inputs passed on uncast) holds a `keras_mp.AmpPolicy` (`mark_policies`): a
Keras dtype policy of the same name, whose class plain Keras does not know.
A `.keras` file of such a model loads where keras_mp is imported, and
computes there what it computed when saved; elsewhere `load_model` fails
with a message that names keras_mp, rather than computing something else.
"""

import functools

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import from_aware_package


class AmpPolicy(keras.DTypePolicy):
    """A Keras dtype policy whose layer keras_mp also casts (`mark_policies`).

    It computes as `keras.DTypePolicy(name)` does; only its class, in a
    saved file, says that the layer needs keras_mp.

    In a model's own config it also carries `layers`: the precision keras_mp
    set for each of the model's layers (`model/config_precision.py`), which
    the model is given back once it is rebuilt; the policy's own config
    then says the model needs keras_mp too.
    """

    def __init__(self, name=None, layers=None):
        super().__init__(name)
        self.layers = layers

    def get_config(self):
        config = super().get_config()
        if self.layers is not None:
            config["layers"] = self.layers
        return config


# Its name in a saved file, and in Keras's error where keras_mp is not
# imported ("Cannot deserialize object of type `keras_mp.AmpPolicy`"), which
# Keras raises for a class saved without a module; where keras_mp is
# imported, Keras finds it by its registered name.
AmpPolicy.__name__ = AmpPolicy.__qualname__ = "keras_mp.AmpPolicy"
keras.saving.register_keras_serializable(package="keras_mp")(AmpPolicy)
AmpPolicy.__module__ = None


def mark_policies(layers, needs_keras_mp):
    """Gives each layer for which `needs_keras_mp(layer)` holds an
    `AmpPolicy` of its policy's name, and the others a plain policy back.
    Quantized and float8 policies are left as they are."""
    for layer in layers:
        policy = layer.dtype_policy
        if type(policy) not in (keras.DTypePolicy, AmpPolicy):
            continue
        wanted = AmpPolicy if needs_keras_mp(layer) else keras.DTypePolicy
        if type(policy) is not wanted:
            layer.dtype_policy = wanted(policy.name)


def _is_amp_policy(dtype):
    """Whether a config's `dtype` entry is a serialized `AmpPolicy`."""
    return isinstance(dtype, dict) and dtype.get("class_name") == AmpPolicy.__name__


def record_in(config):
    """The layers' precision a model's config carries in its `dtype`
    (`AmpPolicy.layers`), or None."""
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if not _is_amp_policy(dtype):
        return None
    return (dtype.get("config") or {}).get("layers")


def with_record(config, record, name):
    """A model's `config` whose `dtype` is an `AmpPolicy` of `name` carrying
    `record`."""
    dtype = keras.dtype_policies.serialize(AmpPolicy(name, record))
    if name is None:  # the global policy where the model is rebuilt
        dtype["config"]["name"] = None
    return {**config, "dtype": dtype}


def without_record(config):
    """`(config, record)`: a model's config without the record of its layers'
    precision (its `dtype` the name of its own policy; none in a functional
    model's, as Keras writes it), and the record (None where it carries
    none)."""
    record = record_in(config)
    if record is None:
        return config, None
    config = dict(config)
    name = config.pop("dtype")["config"].get("name")
    if not ("layers" in config and "input_layers" in config):
        config["dtype"] = name
    return config, record


def without_records(config):
    """A config (a model's, serialized) without the records of every model
    in it: it rebuilds in the policies its layers' configs say."""
    if isinstance(config, dict):
        if record_in(config) is not None:
            config = without_record(config)[0]
        return {k: without_records(v) for k, v in config.items()}
    if isinstance(config, list):
        return [without_records(v) for v in config]
    return config


_LOADABLE_CONFIG_ATTRIBUTE = "_keras_mp_loadable_config"
_BUILT_UNDER_ATTRIBUTE = "_keras_mp_built_under"
# `(model, config, built_under) -> config`: the record of the model's layers' precision
# written into a config its own constructor rebuilds from
# (`model/config_precision.py` installs it).
_record_writers = []


def keep_config_loadable(layer):
    """Makes a block of the user's that computes in half rebuild from its config.

    A layer written as Keras's guides write one makes its sublayers in
    `__init__` without passing its dtype on, and its config does not hold
    them: rebuilt from its config (`load_model`, `clone_model`,
    `serving_copy`), the block gets its saved policy and its sublayers
    Keras's default. Its own arithmetic then mixes half and float32, which
    TensorFlow refuses (Keras's own mixed policies fail the same way in a
    process whose global policy is float32). Such a layer's config gives no
    dtype instead, so that the block comes back in the default policy with
    its sublayers; the record of the model it is in (its own config's,
    `model/config_precision.py`, or its compile config's) then restores the
    precision that keras_mp set (`restore_precision`). A layer of Keras or
    KerasHub passes its dtype on, and a layer whose config holds its
    sublayers' configs rebuilds them with their own: theirs are left as
    they are.
    """
    if layer_tree.is_graph(layer):
        _keep_the_graph_it_was_built_with(layer)
        return
    if getattr(layer, _LOADABLE_CONFIG_ATTRIBUTE, False) or from_aware_package(layer):
        return
    get_config = layer.get_config

    @functools.wraps(get_config)
    def get_config_without_half_dtype():
        config = get_config()
        if (
            isinstance(config, dict)
            and config.get("dtype") is not None
            and layer.dtype_policy.name != keras.config.dtype_policy().name
            and layer_tree.has_sublayers(layer)
            and not holds_layer_configs([v for k, v in config.items() if k != "dtype"])
        ):
            record = record_in(config)
            if record is None:
                config = {**config, "dtype": None}
            else:  # a model of your own: the precision of its layers kept
                config = with_record(config, record, None)
        return config

    object.__setattr__(layer, "get_config", get_config_without_half_dtype)
    object.__setattr__(layer, _LOADABLE_CONFIG_ATTRIBUTE, True)


def holds_layer_configs(value):
    """Whether a config value holds a layer, or a serialized one (a config with
    a dtype)."""
    if isinstance(value, keras.layers.Layer):
        return True
    if isinstance(value, dict):
        config = value.get("config")
        if isinstance(config, dict) and "dtype" in config:
            return True
        return any(holds_layer_configs(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_layer_configs(v) for v in value)
    return False


def _keep_the_graph_it_was_built_with(model):
    """A functional model that its own constructor builds (KerasHub's
    backbones and tasks) rebuilds from its config the graph it has.

    Such a constructor puts raw ops in the graph in the dtype of the moment:
    GemmaBackbone scales its embeddings by `ops.cast(ops.sqrt(hidden_dim),
    x.dtype)`, which built in float32 is 5.656854 and rebuilt from a config
    whose `dtype` is the level's (`mixed_float16`) is float16's 5.65625: the
    loaded model predicted 4e-3 away from the saved one, with the same
    weights and the same policies. Its config therefore gives the dtype it
    was built under, and carries the record of each layer's precision that
    the model is given back once rebuilt (`model/config_precision.py`). A
    plain `keras.Model(inputs, outputs)` saves its ops with their dtypes,
    and Sequential has none: left as they are.
    """
    if type(model) in (keras_internals.Functional, keras.Sequential) or not model.built:
        return
    if _BUILT_UNDER_ATTRIBUTE in model.__dict__:
        return
    object.__setattr__(model, _BUILT_UNDER_ATTRIBUTE, model.dtype_policy)
    get_config = model.get_config

    @functools.wraps(get_config)
    def get_config_built_under():
        config = get_config()
        if not isinstance(config, dict):
            return config
        built_under = model.__dict__[_BUILT_UNDER_ATTRIBUTE]
        if "dtype" in config:
            config = {**config, "dtype": keras.dtype_policies.serialize(built_under)}
        for write in _record_writers:
            config = write(model, config, built_under)
        return config

    object.__setattr__(model, "get_config", get_config_built_under)
