"""LossScaleOptimizer's config: every argument round-trips, and a file keeps
the floor it was saved with."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.steps import numpy


def test_config_round_trips_every_argument():
    inner = keras.optimizers.SGD(learning_rate=0.3, momentum=0.5)
    arguments = dict(
        dynamic=True,
        initial_scale=48.0,
        dynamic_growth_steps=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=1000.0,
        skip_on_overflow=True,
        master_weights=False,
        name="my_lso",
    )
    optimizer = keras_mp.LossScaleOptimizer(inner, **arguments)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert type(restored) is keras_mp.LossScaleOptimizer
    config = restored.get_config()
    for key, value in arguments.items():
        assert config[key] == value, key
    assert config["inner_optimizer"]["config"]["momentum"] == 0.5
    assert restored.get_config() == optimizer.get_config()

    fixed = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=100.0, skip_on_overflow=False
    )
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(fixed))
    assert restored.get_config() == fixed.get_config()
    assert restored.dynamic is False and restored.skip_on_overflow is False


@pytest.mark.parametrize("min_scale", [None, 1.0], ids=["no_floor", "min_scale_1"])
def test_a_saved_file_keeps_its_floor(tmp_path, min_scale):
    """`min_scale=None` (no floor, the default) stays None; a file saved with
    tf.keras 2's floor of 1 (the default of earlier releases) loads with it,
    and its scale stops there."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0, min_scale=min_scale
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((2, 2), np.float32), np.ones((2, 1)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.min_scale == min_scale
    assert loaded.optimizer.get_config() == optimizer.get_config()
    nan_batch = np.full((2, 2), np.nan, np.float32)
    for _ in range(3):
        loaded.fit(nan_batch, np.ones((2, 1)), verbose=0)
    assert float(numpy(loaded.optimizer.loss_scale)) == (0.25 if min_scale is None else 1.0)
