"""Code ported from tf.keras 2, and Keras's own LossScaleOptimizer under `amp_level`.

tf.keras 2's `LossScaleOptimizer` arguments, names and refusals, as its users
wrote them; and Keras 3's built-in optimizer handed to `compile(amp_level=...)`,
which keras_mp takes over (settings and state kept) so that a bad batch
still loses nothing.
"""

import keras
import numpy as np
import pytest

import keras_mp

# Arguments, configs and which optimizer `compile` keeps: the same on every
# backend. The skip they lead to is each backend's own, proven in
# tests/model/test_compile.py and test_train_step.py.
pytestmark = pytest.mark.one_backend


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _sgd():
    return keras.optimizers.SGD(0.01)


# -- tf.keras 2 arguments ------------------------------------------------------


@pytest.mark.parametrize("steps, expected", [(None, 2000), (3.0, 3), (7, 7)])
def test_dynamic_growth_steps_takes_tf_keras2_forms(steps, expected):
    optimizer = keras_mp.LossScaleOptimizer(_sgd(), dynamic_growth_steps=steps)
    assert optimizer.dynamic_growth_steps == expected
    assert type(optimizer.dynamic_growth_steps) is int
    assert optimizer.get_config()["dynamic_growth_steps"] == expected


def test_fixed_scale_has_no_growth_steps_and_loads_tf_keras2_configs():
    fixed = keras_mp.LossScaleOptimizer(_sgd(), dynamic=False, initial_scale=128.0)
    assert fixed.dynamic_growth_steps is None
    assert fixed.get_config()["dynamic_growth_steps"] is None
    # tf.keras 2 wrote `dynamic_growth_steps: None` for a fixed scale.
    config = {
        "inner_optimizer": keras.saving.serialize_keras_object(_sgd()),
        "dynamic": False,
        "initial_scale": 128.0,
        "dynamic_growth_steps": None,
    }
    loaded = keras_mp.LossScaleOptimizer.from_config(config)
    assert loaded.dynamic is False and loaded.dynamic_growth_steps is None
    assert float(_numpy(loaded.loss_scale)) == 128.0
    # keras_mp 0.1 wrote 2000 there; its files still load.
    loaded = keras_mp.LossScaleOptimizer.from_config(dict(config, dynamic_growth_steps=2000))
    assert loaded.dynamic_growth_steps is None


@pytest.mark.parametrize("steps", [2000, 5, 3.0])
def test_fixed_scale_refuses_growth_steps(steps):
    with pytest.raises(ValueError) as info:
        keras_mp.LossScaleOptimizer(
            _sgd(), dynamic=False, initial_scale=8.0, dynamic_growth_steps=steps
        )
    assert f"Received: dynamic=False, dynamic_growth_steps={steps!r}" in str(info.value)
    assert "`dynamic_growth_steps`" in str(info.value)


@pytest.mark.parametrize("steps", [2.5, 0.0, -1, float("nan"), float("inf"), "3", True])
def test_growth_steps_refuses_what_is_not_a_whole_number(steps):
    with pytest.raises(ValueError, match="`dynamic_growth_steps` must be an integer >= 1") as info:
        keras_mp.LossScaleOptimizer(_sgd(), dynamic_growth_steps=steps)
    assert f"dynamic_growth_steps={steps!r}" in str(info.value)


def test_compiling_twice_with_one_optimizer_keeps_its_wrapper():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    adam = keras.optimizers.Adam()
    model.compile(optimizer=adam, loss="mse", amp_level="O2")
    wrapper = model.optimizer
    model.compile(optimizer=adam, loss="mse", amp_level="O2")
    assert model.optimizer is wrapper and wrapper.inner_optimizer is adam
    # A different loss scale for the same optimizer is another wrapper, which
    # may not step `adam` beside the first: a new Adam of the same settings
    # takes its place, and keras_mp says so.
    with pytest.warns(UserWarning, match="a new Adam of the same settings"):
        model.compile(optimizer=adam, loss="mse", amp_level="O2", loss_scale=128.0)
    assert model.optimizer.initial_scale == 128.0 and not model.optimizer.dynamic
    assert model.optimizer.inner_optimizer is not adam
    assert model.optimizer.inner_optimizer.get_config() == adam.get_config()


# -- Keras's own LossScaleOptimizer under amp_level -----------------------------


def _bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")


@pytest.mark.parametrize("amp", [{"amp_level": "O2"}, {"amp_level": "O1", "amp_dtype": "bfloat16"}])
def test_keras_loss_scale_optimizer_is_taken_over_with_its_settings(amp):
    keras_lso = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**10, dynamic_growth_steps=3
    )
    model = _bn_model()
    with pytest.warns(UserWarning, match="replaced keras.optimizers.LossScaleOptimizer"):
        model.compile(optimizer=keras_lso, loss="mse", **amp)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer)
    assert optimizer.inner_optimizer is keras_lso.inner_optimizer
    assert optimizer.initial_scale == 2.0**10 and optimizer.dynamic_growth_steps == 3

    x, y = _data()
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert "loss_scale" in history.history  # the scale is logged
    assert float(_numpy(optimizer.loss_scale)) == 2.0**11  # 4 steps: grew once
    # One NaN batch: skipped, and BatchNorm's statistics are kept too.
    layer_weights = [_numpy(w) for w in model.weights]
    x_bad = x[:4].copy()
    x_bad[0, 0] = np.nan
    model.train_on_batch(x_bad, y[:4])
    for before, after in zip(layer_weights, model.weights):
        np.testing.assert_array_equal(before, _numpy(after))
    assert int(_numpy(optimizer.skipped_steps)) == 1
    assert np.isfinite(_numpy(model.predict(x, verbose=0))).all()


def test_keras_loss_scale_optimizer_state_comes_along():
    """A Keras optimizer that already trained: its scale and counter carry over."""
    model = _bn_model()
    keras_lso = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**12, dynamic_growth_steps=100
    )
    model.compile(optimizer=keras_lso, loss="mse")
    x, y = _data()
    x_bad = x.copy()
    x_bad[0, 0] = np.inf
    model.train_on_batch(x_bad[:4], y[:4])  # halves Keras's scale
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 4 good steps
    assert float(_numpy(keras_lso.dynamic_scale)) == 2.0**11
    with pytest.warns(UserWarning, match="replaced"):
        model.compile(optimizer=keras_lso, loss="mse", amp_level="O2")
    assert float(_numpy(model.optimizer.loss_scale)) == 2.0**11
    assert int(_numpy(model.optimizer.good_steps)) == 4
