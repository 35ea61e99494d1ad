"""`LossScaleOptimizer`'s config: every argument, and configs of older files.

`get_config` holds every argument as the user gave it (`min_scale=None`
stays None, a file saved with `min_scale=1.0` loads with 1.0), so that
`keras.saving` round-trips the optimizer and a `.keras` file resumes with
the same settings.
"""

import dataclasses

import keras


class ConfigRoundTrip:
    """Mixed into `LossScaleOptimizer`."""

    def get_config(self):
        # Not `super().get_config()`: the base arguments belong to the inner
        # optimizer.
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **dataclasses.asdict(self._config),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "master_weights": self._master_weights,
            "shard_optimizer_state": self._shard_optimizer_state,
            "moment_dtypes": list(self._moment_dtypes) if self._moment_dtypes else None,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = config_of_older_releases(config)
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)


def config_of_older_releases(config):
    """A config that an older keras_mp wrote, as this release reads it.

    Every release wrote `min_scale`, so a file keeps the floor it was saved
    with (1.0 before `None` became the default).
    """
    config = dict(config)
    if config.get("dynamic") is False and config.get("dynamic_growth_steps") == 2000:
        # Written by keras_mp 0.1 for a fixed scale (now `None`).
        config["dynamic_growth_steps"] = None
    return config
