"""The names tf.keras 2 and Keras's built-in LossScaleOptimizer gave things:
`get_scaled_loss`/`get_unscaled_gradients`, `dynamic_scale`, `step_counter`,
`dynamic_counter`, as code written for them uses them."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp

BACKEND = keras.backend.backend()


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _tensor(values, dtype="float32"):
    return keras.ops.convert_to_tensor(np.asarray(values, dtype=dtype))


def _sgd():
    return keras.optimizers.SGD(0.01)


def test_dynamic_counter_is_the_good_steps_counter():
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = keras_mp.LossScaleOptimizer(_sgd(), initial_scale=4.0, dynamic_growth_steps=5)
    assert optimizer.dynamic_counter is optimizer.good_steps
    for _ in range(3):
        optimizer.apply([keras.ops.ones(2)], [variable])
    assert int(_numpy(optimizer.dynamic_counter)) == 3
    # A fixed scale has none, as in tf.keras 2.
    fixed = keras_mp.LossScaleOptimizer(_sgd(), dynamic=False, initial_scale=8.0)
    assert fixed.dynamic_counter is None


def test_unscaling_gradients_of_an_unscaled_loss_warns():
    optimizer = keras_mp.LossScaleOptimizer(_sgd())
    grads = [keras.ops.ones(2)]
    with pytest.warns(
        UserWarning, match="get_unscaled_gradients was called, but the loss was never"
    ):
        optimizer.get_unscaled_gradients(grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.get_scaled_loss(keras.ops.ones(()))
        optimizer.get_unscaled_gradients(grads)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.function")
def test_a_loss_scaled_in_a_tf_function_does_not_warn_at_later_steps():
    """tf.keras 2's loop with the gradients taken in a `tf.function` and
    unscaled outside it: the function scales the loss in Python only when
    it is traced, and the later steps are as scaled as the first."""
    import tensorflow as tf

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras_mp.LossScaleOptimizer(_sgd())

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
            scaled_loss = optimizer.get_scaled_loss(loss)
        return tape.gradient(scaled_loss, model.trainable_variables)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            grads = optimizer.get_unscaled_gradients(gradients(np.ones((4, 3), "float32")))
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 3


def test_keras_attribute_names_alias_the_state():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=8.0, dynamic_growth_steps=3
    )
    assert optimizer.dynamic_scale is optimizer.loss_scale
    assert optimizer.step_counter is optimizer.good_steps
    assert optimizer.initial_scale == 8.0
    assert optimizer.dynamic_growth_steps == 3
    names = [v.path.split("/")[-1] for v in optimizer.variables]
    for name in ("loss_scale", "good_steps", "skipped_steps"):
        assert name in names
    assert float(_numpy(optimizer.scale_loss(2.0))) == 16.0


def test_get_unscaled_gradients_keeps_dtypes():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2.0**20, max_scale=2.0**24
    )
    optimizer.get_scaled_loss(_tensor(1.0, "float32"))
    grads = optimizer.get_unscaled_gradients(
        [_tensor([1024.0], "float16"), _tensor([2.0**21], "float32"), None]
    )
    assert keras.backend.standardize_dtype(grads[0].dtype) == "float16"
    assert _numpy(grads[0])[0] == np.float16(2.0**-10)  # divided in float32
    assert _numpy(grads[1])[0] == 2.0
    assert grads[2] is None
