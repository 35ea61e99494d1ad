"""Keras's internals keras_mp uses, in one place: each is there in this Keras,
and one that is missing fails with the Keras version and the name."""

import keras
import numpy as np
import pytest

from keras_mp._src import keras_internals


def test_every_internal_is_there():
    for name in (
        "Trainer",
        "Functional",
        "get_keras_mask",
        "set_keras_mask",
        "AutocastScope",
        "print_msg",
        "no_automatic_dependency_tracking",
        "LossFunctionWrapper",
        "get_input_signature",
    ):
        assert getattr(keras_internals, name) is not None, name
    assert keras_internals.aggregate_additional_loss is not None  # Keras 3.15 has it
    assert issubclass(keras.Model, keras_internals.Trainer)


def test_a_missing_internal_names_the_keras_version_and_itself():
    with pytest.raises(keras_internals.KerasInternalsError) as info:
        keras_internals._need("keras.src.trainers.trainer", "NoSuchThing")
    message = str(info.value)
    assert "keras.src.trainers.trainer.NoSuchThing" in message
    assert f"Keras {keras.__version__}" in message and keras_internals.TESTED in message
    with pytest.raises(ImportError, match="keras.src.nowhere.Thing"):
        keras_internals._need("keras.src.nowhere", "Thing")


def test_layer_and_variable_helpers():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs))
    (dense,) = [c for c in keras_internals.children(model) if c.name == "d"]
    assert dense in keras_internals.all_layers(model)
    assert keras_internals.output_operations(model) == [dense]
    assert keras_internals.built_input_shape(dense) == (None, 3)
    assert [v.name for v in keras_internals.own_variables(dense)] == ["kernel", "bias"]
    kernel = dense.kernel
    before = np.asarray(keras.ops.convert_to_numpy(kernel))
    keras_internals.recast(kernel, "float16")
    assert dense.kernel is kernel and kernel.dtype == "float16"
    after = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(kernel, "float32")))
    np.testing.assert_array_equal(after, before.astype("float16").astype("float32"))
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    assert list(keras_internals.built_variables(optimizer)) == model.trainable_variables


def test_model_helpers():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    keras_internals.record_in_compile_config(model, amp_level="O2")
    assert model.get_compile_config()["amp_level"] == "O2"
    assert keras_internals.call_takes_training(model)
