"""Configs of your own blocks that rebuild in the precision keras_mp set.

`apply_amp` gives this to each layer it sets a policy on
(`keep_config_loadable`); it changes a layer's `get_config` only for a
block of the user's written as Keras's guides write one.
"""

import functools

import keras

from keras_mp._src import layer_tree
from keras_mp._src.layer_kinds import from_aware_package

_LOADABLE_CONFIG_ATTRIBUTE = "_keras_mp_loadable_config"


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
    its sublayers; `compile_from_config` then restores the precision that
    keras_mp set (`restore_precision`). A layer of Keras or KerasHub passes
    its dtype on, and a layer whose config holds its sublayers' configs
    rebuilds them with their own: theirs are left as they are.
    """
    if (
        getattr(layer, _LOADABLE_CONFIG_ATTRIBUTE, False)
        or layer_tree.is_graph(layer)
        or from_aware_package(layer)
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
            and layer_tree.has_sublayers(layer)
            and not holds_layer_configs([v for k, v in config.items() if k != "dtype"])
        ):
            config = {**config, "dtype": None}
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
