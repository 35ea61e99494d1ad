"""Variables from inside: a layer's own, a dtype changed in place (same
object, its value rounded), the ones an optimizer was built on."""

import keras
import numpy as np

from keras_mp._src import keras_internals


def test_own_variables_recast_in_place_and_an_optimizer_s():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(2, name="d")
    model = keras.Model(inputs, dense(inputs))
    assert [v.name for v in keras_internals.own_variables(dense)] == ["kernel", "bias"]
    assert keras_internals.own_trainable_variables(dense) == [dense.kernel, dense.bias]
    assert keras_internals.hold_values(model.variables)
    kernel = dense.kernel
    before = np.asarray(keras.ops.convert_to_numpy(kernel))
    keras_internals.recast(kernel, "float16")
    assert dense.kernel is kernel and kernel.dtype == "float16"
    after = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(kernel, "float32")))
    np.testing.assert_array_equal(after, before.astype("float16").astype("float32"))
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    assert list(keras_internals.built_variables(optimizer)) == model.trainable_variables
    assert keras_internals.variable_layout(kernel) is None  # no distribution


def test_a_frozen_weight_recast_trains_once_unfrozen():
    """A weight recast while frozen, then unfrozen, is trainable again (a
    recast keeps the flag TensorFlow's variable was created with)."""
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    dense.trainable = False
    keras_internals.recast(dense.kernel, "float16")
    dense.trainable = True
    assert dense.kernel.trainable and dense.kernel in dense.trainable_variables
