"""Walks of the layer tree: parents first in the order layers were added,
each layer once, and the layers whose outputs are the model's outputs."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import layer_tree

pytestmark = pytest.mark.one_backend


def _nested():
    inner = keras.Sequential(
        [keras.layers.Dense(4, name="first"), keras.layers.ReLU(name="second")], name="inner"
    )
    inputs = keras.Input((3,))
    shared = keras.layers.Dense(4, name="shared")
    a = inner(shared(inputs))
    b = keras.layers.Dense(2, name="head_a")(a)
    c = keras.layers.Dense(1, name="head_b")(shared(inputs))  # `shared` called twice
    return keras.Model(inputs, [b, c], name="outer"), inner, shared


def _names(layers):
    return [layer.name for layer in layers if not isinstance(layer, keras.layers.InputLayer)]


def test_layers_in_order_lists_each_layer_once_parents_first():
    model, inner, shared = _nested()
    names = _names(layer_tree.layers_in_order(model))
    assert names == ["outer", "shared", "inner", "first", "second", "head_a", "head_b"]
    parents = {layer.name: parent for layer, parent in layer_tree.tree(model)}
    assert parents["outer"] is None
    assert parents["first"] is inner and parents["inner"] is model
    assert parents["shared"] is model


def test_output_layers_of_a_functional_model_reach_into_nested_models():
    model, inner, _ = _nested()
    assert _names(layer_tree.output_layers(model)) == ["head_a", "head_b"]
    outputs = keras.Model(model.inputs, inner(model.get_layer("shared").output))
    assert _names(layer_tree.output_layers(outputs)) == ["second"]  # inside `inner`


def test_output_layers_of_a_subclassed_model_are_it_and_the_models_it_holds():
    class Holder(keras.Model):
        def __init__(self):
            super().__init__(name="holder")
            self.generator = keras.Sequential([keras.layers.Dense(2, name="g_out")])
            self.critic = keras.layers.Dense(1, name="critic")

        def call(self, x):
            return self.critic(self.generator(x))

    holder = Holder()
    holder(np.ones((1, 3), "float32"))
    assert _names(layer_tree.output_layers(holder)) == ["holder", "g_out"]
    assert layer_tree.is_subclassed(holder) and not layer_tree.is_graph(holder)
    assert layer_tree.is_graph(holder.generator) and layer_tree.is_container(holder.generator)
    assert layer_tree.has_sublayers(holder) and not layer_tree.has_sublayers(holder.critic)


class _Private(keras.Model):
    """Named `__private` by Keras: a name TensorFlow refuses as a root scope."""

    def __init__(self):
        super().__init__()
        self.late = keras.layers.Dense(2, name="late")  # made first, called last
        self.early = keras.layers.Dense(4, name="early")

    def call(self, x):
        return self.late(self.early(x))


def test_call_order_is_the_order_call_runs_and_leaves_the_layers_as_they_were():
    model = _Private()
    model(np.zeros((1, 3), "float32"))
    assert _names(layer_tree.layers_in_order(model)[1:]) == ["late", "early"]
    assert _names(layer_tree.call_order(model, (1, 3))) == ["early", "late"]
    assert "call" not in vars(model.early) and "call" not in vars(model.late)


def test_applying_amp_to_a_model_named_with_an_underscore_leaves_later_names_alone():
    """The symbolic pass that finds a subclassed model's head runs it in a new
    graph on TensorFlow, which refuses `__private` as a root scope: the
    refusal must not leave the name pushed on Keras's scope stack, where
    every variable made afterwards in the process would be named under it."""
    import keras_mp

    model = _Private()
    model(np.zeros((1, 3), "float32"))
    keras_mp.apply_amp(model, "O2", "float16")
    later = keras.layers.Dense(1, name="later")
    later.build((None, 3))
    assert later.kernel.path == "later/kernel"


def _tied(one_graph):
    """A tied language model: KerasHub's shape (a backbone, its table's
    `reverse=True` on the backbone's output), or one graph calling the table
    twice (its lookup, then its logits)."""
    keras.utils.set_random_seed(0)
    table = keras.layers.ReversibleEmbedding(32, 8, name="token_embedding")
    tokens = keras.Input((6,), dtype="int32")
    block = keras.layers.Dense(8, name="block")
    if one_graph:
        return keras.Model(tokens, table(block(table(tokens)), reverse=True))
    backbone = keras.Model(tokens, block(table(tokens)))
    return keras.Model(tokens, table(backbone(tokens), reverse=True))


def test_a_layer_called_twice_is_an_output_where_its_last_call_is():
    """A tied embedding's lookup feeds the model, its logits are the model's
    output. The layer was taken for an intermediate output (a feature
    extractor's, which the model casts itself), so its head got no entry
    cast: it multiplied half inputs by its float32 table in float32, while
    the summary said half; built as KerasHub builds it, the head took half."""
    import keras_mp

    x = np.random.default_rng(0).integers(0, 32, (4, 6)).astype("int32")
    outputs, summaries = [], []
    for one_graph in (True, False):
        model = _tied(one_graph)
        assert "token_embedding" in [layer.name for layer in layer_tree.output_layers(model)]
        keras_mp.apply_amp(model, "O2", "bfloat16")
        outputs.append(np.asarray(model.predict(x, verbose=0)))
        rows = keras_mp.precision_summary(model).rows
        summaries.append([r["rule"] for r in rows if r["layer"] == "token_embedding"])
    assert outputs[0].dtype == "float32"
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert summaries[0] == summaries[1]
