"""Optimizer state loaded before the optimizer is built is kept for its build
(`deferred_loading.py`), where Keras skips it and the run restarts fresh."""

import warnings

import keras
import numpy as np

import keras_mp
from tests import models


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _compiled():
    model = models.dense_bn_classifier()
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**8, dynamic_growth_steps=2
        ),
        loss="sparse_categorical_crossentropy",
        amp_level="O2",
    )
    return model


def test_weights_loaded_into_an_unbuilt_optimizer_reach_it_at_its_build(tmp_path):
    x, y = models.three_class_data(64)
    trained = _compiled()
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "run.weights.h5")
    trained.save_weights(path)

    resumed = _compiled()
    assert not resumed.optimizer.built
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Keras's "not built yet"
        resumed.load_weights(path)
    # Its own state now, so that the first step scales by the saved scale.
    assert (
        float(_numpy(resumed.optimizer.loss_scale))
        == float(_numpy(trained.optimizer.loss_scale))
        == 2.0**12
    )  # grown four times in 8 finite steps
    resumed.optimizer.build(resumed.trainable_variables)
    for saved, loaded in zip(trained.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_array_equal(_numpy(loaded), _numpy(saved), err_msg=saved.path)
    # And the next epoch is the uninterrupted run's, bit for bit.
    trained.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    resumed.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(trained.weights, resumed.weights):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)
