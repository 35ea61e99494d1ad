"""Keras's trainer from inside: the methods keras_mp extends are there, and
the compile config takes the amp settings."""

import keras
import pytest

from keras_mp._src import keras_internals

# Keras's generic internals: the same whichever backend runs.
pytestmark = pytest.mark.one_backend


def test_the_trainer_internals_are_there():
    for name in ("Trainer", "print_msg", "LossFunctionWrapper"):
        assert getattr(keras_internals, name) is not None, name
    assert keras_internals.aggregate_additional_loss is not None  # Keras 3.15 has it
    assert issubclass(keras.Model, keras_internals.Trainer)


def test_model_helpers():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    keras_internals.record_in_compile_config(model, amp_level="O2")
    assert model.get_compile_config()["amp_level"] == "O2"
    assert keras_internals.call_takes_training(model)
