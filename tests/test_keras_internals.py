"""Keras's internals keras_mp uses, in one place: each is there in this Keras,
and one that is missing fails with the Keras version and the name."""

import subprocess
import sys

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
        "PROBABILITY_OPERATIONS",
        "backend_nn",
        "is_remote_path",
        "BackupAndRestore",
        "Layer",
        "cloning",
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


@pytest.mark.parametrize("version", ["3.9.2", "3.8.0", "3.0.0", "2.15.0"])
def test_a_keras_older_than_the_floor_is_refused_by_name(version):
    with pytest.raises(keras_internals.KerasTooOldError) as raised:
        keras_internals.check_keras_version(version)
    message = str(raised.value)
    assert f"this environment has Keras {version}" in message
    assert "keras_mp needs Keras 3.10 or newer" in message
    assert "pip install -U 'keras>=3.10'" in message


@pytest.mark.parametrize("version", ["3.10.0", "3.10.1.dev2025", "3.15.1", "3.16.0rc1"])
def test_the_floor_and_newer_are_taken(version):
    keras_internals.check_keras_version(version)


def test_an_old_keras_fails_at_import_not_later():
    """Where the installed Keras says it is older than the floor, `import
    keras_mp` raises, before anything else of it runs."""
    code = "import keras; keras.__version__ = '3.9.2'; import keras_mp"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "KerasTooOldError: keras_mp needs Keras 3.10 or newer" in result.stderr
