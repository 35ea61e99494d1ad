"""A custom training loop's model, data and float64 reference of one SGD
step, shared by the tests of each way to write the loop."""

import keras
import numpy as np


def loop_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def loop_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


def reference_weights_after_one_sgd_step(x, y):
    """float64 reference of one SGD(0.1) step on the mean squared error."""
    model = loop_model()
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    error = x @ kernel + bias - y
    d = 2.0 * error / error.size
    return [kernel - 0.1 * (x.T @ d), bias - 0.1 * d.sum(0)]


def check_loop_result(model, x, y):
    expected = reference_weights_after_one_sgd_step(x, y)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
