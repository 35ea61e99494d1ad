"""Layers from inside: their sublayers, the shapes they were built on, the
state they created, and the names keras_mp reads from Keras's layers."""

import keras
import pytest

from keras_mp._src import keras_internals

# Keras's generic internals: the same whichever backend runs.
pytestmark = pytest.mark.one_backend


def test_the_layer_internals_are_there():
    for name in ("get_keras_mask", "set_keras_mask", "AutocastScope", "backend_nn"):
        assert getattr(keras_internals, name) is not None, name
    assert keras_internals.no_automatic_dependency_tracking is not None


def test_sublayers_shapes_and_state():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dropout(0.5, name="drop")(keras.layers.Dense(4, name="d")(inputs))
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(hidden))
    by_name = {c.name: c for c in keras_internals.children(model)}
    assert {"d", "drop", "bn"} <= set(by_name)
    assert by_name["d"] in keras_internals.all_layers(model)
    assert keras_internals.built_input_shape(by_name["d"]) == (None, 3)
    assert keras_internals.build_shapes(by_name["d"]) == {"input_shape": (None, 3)}
    # State a forward pass may change: BatchNorm's statistics, Dropout's seed.
    assert keras_internals.has_state(by_name["bn"]) and keras_internals.has_state(by_name["drop"])
    assert not keras_internals.has_state(by_name["d"])
    assert keras_internals.attributes(by_name["d"])["units"] == 4


def test_the_call_context_and_the_open_layer_scopes():
    seen = {}

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            seen["training"] = keras_internals.call_in_training()
            seen["scopes"] = keras_internals.layer_scopes()
            return x

    Probe()(keras.ops.ones((1, 2)), training=True)
    assert seen == {"training": True, "scopes": 1}
    assert not keras_internals.call_in_training()  # outside any call
    assert keras_internals.stateless_scope() is None
    with keras.StatelessScope() as scope:
        assert keras_internals.stateless_scope() is scope


def test_keras_own_layer_classes_are_told_from_the_users():
    """`find_optimizers` passes over Keras's own layers (they hold no
    optimizer); a subclass of the user's, a model, are looked at."""

    class Mine(keras.layers.Dense):
        pass

    assert keras_internals.is_keras_layer_class(keras.layers.Dense(2))
    assert keras_internals.is_keras_layer_class(keras.layers.BatchNormalization())
    assert not keras_internals.is_keras_layer_class(Mine(2))
    assert not keras_internals.is_keras_layer_class(keras.Sequential([keras.layers.Dense(2)]))
