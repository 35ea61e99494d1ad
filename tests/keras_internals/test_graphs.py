"""Keras's graphs: a functional model's operations, the call that made a
tensor, and a symbolic pass that leaves the layers as it found them."""

import keras
import pytest

from keras_mp._src import keras_internals

# Keras's generic internals: the same whichever backend runs.
pytestmark = pytest.mark.one_backend


def _model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    out = keras.layers.Dense(2, name="out")(hidden)
    return keras.Model(inputs, {"out": out, "hidden": hidden})


def test_a_functional_model_s_operations():
    model = _model()
    hidden, out = model.get_layer("hidden"), model.get_layer("out")
    assert set(map(id, keras_internals.output_operations(model))) == {id(hidden), id(out)}
    consumed = keras_internals.consumed_outputs(model)
    keys = {
        keras_internals.made_by(t)[0].name: keras_internals.output_key(t) for t in model.outputs
    }
    assert keys["hidden"] in consumed and keys["out"] not in consumed
    assert set(keras_internals.graph_outputs(model)) == {"out", "hidden"}
    parents = dict((id(op), ps) for op, ps in keras_internals.operations_from_inputs(model))
    assert parents[id(out)] == [hidden]
    operation, index, inputs, _ = keras_internals.made_by(model.outputs[0])
    assert operation in (hidden, out) and index == 0 and len(inputs) == 1
    assert set(keras_internals.PROBABILITY_OPERATIONS) == {"softmax", "log_softmax", "sigmoid"}


def test_a_symbolic_pass_leaves_no_node_behind():
    model = _model()
    hidden = model.get_layer("hidden")
    nodes = (len(hidden._inbound_nodes), len(hidden._outbound_nodes))
    with keras_internals.symbolic_calls(model) as consumed:
        x = hidden(keras.KerasTensor((1, 3)))
        model.get_layer("out")(x)
        assert consumed(hidden)
    assert (len(hidden._inbound_nodes), len(hidden._outbound_nodes)) == nodes
    spec = keras_internals.compute_output_spec(model, keras.KerasTensor((2, 3)))
    assert spec["out"].shape == (2, 2)
