"""A language model's head and its trunk: the layer that makes a graph
model's one output, and a model up to the tensor it takes in."""

import keras
import pytest

from keras_mp._src.precision import lm_head

pytestmark = pytest.mark.one_backend


def _functional(head):
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(11, 4)(tokens)
    hidden = keras.layers.LayerNormalization()(hidden)
    return keras.Model(tokens, head(hidden))


def test_a_dense_head_and_the_model_up_to_it():
    model = _functional(keras.layers.Dense(11, name="logits"))
    found = lm_head.find(model)
    assert found.layer.name == "logits" and found.passes_mask
    assert found.trunk.output.shape == (None, 5, 4)
    # The trunk shares the model's layers: the same weights.
    assert {id(w) for w in found.trunk.weights} < {id(w) for w in model.weights}


def test_a_tied_embedding_read_in_reverse():
    embedding = keras.layers.ReversibleEmbedding(11, 4, name="table")
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(4)(embedding(tokens))
    found = lm_head.find(keras.Model(tokens, embedding(hidden, reverse=True)))
    assert found.layer is embedding and not found.passes_mask
    assert found.trunk.output.shape == (None, 5, 4)


@pytest.mark.parametrize(
    "model, why",
    [
        (lambda: _functional(keras.layers.Dense(11, activation="softmax")), "its output layer"),
        (lambda: _functional(keras.layers.Conv1D(11, 1)), "is not a linear Dense"),
        (lambda: keras.Sequential([keras.layers.Dense(3)]), "not built on an input yet"),
    ],
    ids=["softmax", "conv", "unbuilt"],
)
def test_no_head_says_why(model, why):
    found = lm_head.find(model())
    assert found.layer is None and why in found.why


def test_a_sequential_built_on_a_shape():
    """`build(shape)`, no Input: its graph is Keras's own functional copy."""
    model = keras.Sequential([keras.layers.Embedding(11, 4), keras.layers.Dense(11)])
    model.build((None, 5))
    found = lm_head.find(model)
    assert found.layer is model.layers[-1]
    assert found.trunk.output.shape == (None, 5, 4)
