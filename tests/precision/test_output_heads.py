"""The head rule finds every output (`output_heads.py`, issue 75.1): dict
and nested outputs paired with their losses as Keras pairs them, every
output of a subclassed model (built before `compile` or after it), the
layers inside a user's own head layer.

The price heads below predict 1.28e5 from inputs of 2000 (inf in float16):
each was left in float16 before. The rule's decision is the same on every
backend: proven on PyTorch.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.precision import output_heads

L = keras.layers
pytestmark = pytest.mark.one_backend
ONES = keras.initializers.Constant(1.0)
X = np.full((2, 8), 2000.0, "float32")  # 8 * 2000 * 8 = 128000 at a price head
SCE = "sparse_categorical_crossentropy"


def _dtypes(model):
    return {
        layer.name: layer.compute_dtype
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, L.Dense)
    }


def _functional(outputs):
    inputs = keras.Input((8,))
    body = L.Dense(8, kernel_initializer=ONES, name="body")(inputs)
    heads = {
        "price": L.Dense(1, kernel_initializer=ONES, name="price")(body),
        "cls": L.Dense(3, name="cls")(body),
    }
    return keras.Model(inputs, outputs(heads))


@pytest.mark.parametrize(
    "outputs, loss",
    [
        # Keras packs a list into a dict's sorted keys: "cls" first.
        (lambda h: {"price": h["price"], "cls": h["cls"]}, [SCE, "mae"]),
        (lambda h: {"out": [h["price"], h["cls"]]}, {"out": ["mae", SCE]}),
        (lambda h: [h["cls"], h["price"]], {"price": "mae", "cls": SCE}),
    ],
    ids=["dict_outputs_list_loss", "nested", "list_outputs_loss_by_name"],
)
def test_each_output_gets_the_loss_keras_gives_it(outputs, loss):
    model = _functional(outputs)
    model.compile(optimizer="adam", loss=loss, amp_level="O2")
    assert _dtypes(model) == {"body": "float16", "price": "float32", "cls": "float16"}
    predicted = keras.tree.flatten(model.predict(X, verbose=0))
    assert all(np.all(np.isfinite(p)) for p in predicted)


def test_keras_reads_a_list_loss_in_sorted_key_order():
    """What the rule follows: Keras's own fit gives the MAE to "price"."""
    model = _functional(lambda h: {"price": h["price"], "cls": h["cls"]})
    model.compile(optimizer="sgd", loss=[SCE, "mae"], amp_level="O2")
    y = {"price": np.full((2, 1), 1.28e5, "float32"), "cls": np.zeros((2,), "int32")}
    logs = model.train_on_batch(X * 1e-3, y, return_dict=True)
    assert logs["price_loss"] > 1e4 > logs["cls_loss"]


class TwoHeads(keras.Model):
    def __init__(self):
        super().__init__()
        self.body = L.Dense(8, kernel_initializer=ONES, name="body")
        self.price = L.Dense(1, kernel_initializer=ONES, name="price")
        self.cls = L.Dense(3, name="cls")

    def call(self, x):
        h = self.body(x)
        # The price head is not the last layer called, and a Keras op
        # stands between it and the output.
        return keras.ops.squeeze(self.price(h), -1), self.cls(h)


@pytest.mark.parametrize("built", ["built_first", "compiled_first"])
def test_every_output_of_a_subclassed_model_is_a_head(built):
    model = TwoHeads()
    if built == "built_first":
        model(X)
    model.compile(optimizer="adam", loss=["mae", SCE], amp_level="O2")
    if built == "compiled_first":  # decided again when `fit` builds it
        model.fit(X * 1e-3, (np.zeros(2), np.zeros(2)), epochs=1, verbose=0)
    assert _dtypes(model) == {"body": "float16", "price": "float32", "cls": "float16"}
    price, _ = model.predict(X, verbose=0)
    np.testing.assert_allclose(price, 128000.0)
    # The trace left no node on the layers (called only on tensors).
    with pytest.raises(AttributeError):
        model.price.output


class Untraceable(TwoHeads):
    def call(self, x):
        h = self.body(x)
        # A value read in Python: no symbolic trace can run this call.
        if float(keras.ops.convert_to_numpy(keras.ops.max(x))) > 1e9:
            h = h * 0.0
        return keras.ops.squeeze(self.price(h), -1), self.cls(h)


def test_a_call_that_cannot_be_traced_keeps_as_many_heads_as_losses_in_float32():
    """Which layer makes which output is not known: its last two layers
    with weights, one per loss, each given the regression's loss (the
    cautious one). The price head, not the last layer called, no longer
    predicts inf at O2 float16."""
    model = Untraceable()
    model(X)
    model.compile(optimizer="adam", loss=["mae", SCE], amp_level="O2")
    assert _dtypes(model) == {"body": "float16", "price": "float32", "cls": "float32"}
    price, _ = model.predict(X, verbose=0)
    np.testing.assert_allclose(price, 128000.0)


def test_a_model_compiled_before_it_is_built_is_decided_when_built():
    """At O3 its price head's variables are float32 once built; a layer set
    by hand in between (`to_float`) keeps what it was given."""
    model = TwoHeads()
    model.compile(optimizer="adam", loss=["mae", SCE], amp_level="O3")
    keras_mp.to_float(model.cls, "float32")
    model(X[:1])
    assert _dtypes(model) == {"body": "float16", "price": "float32", "cls": "float32"}
    assert [w.dtype for w in model.price.weights] == ["float32", "float32"]
    assert [w.dtype for w in model.body.weights] == ["float16", "float16"]


@keras.saving.register_keras_serializable(package="test_output_heads")
class Head(L.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = L.Dense(units, kernel_initializer=ONES, name="inner")

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.parametrize("loss, inner", [("mae", "float32"), (SCE, "float16")])
def test_the_layers_inside_a_head_of_yours_follow_the_head_rule(loss, inner):
    inputs = keras.Input((8,))
    body = L.Dense(8, kernel_initializer=ONES, name="body")(inputs)
    model = keras.Model(inputs, Head(1 if loss == "mae" else 3, name="head")(body))
    model.compile(optimizer="adam", loss=loss, amp_level="O2")
    assert _dtypes(model) == {"body": "float16", "inner": inner}
    rows = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert rows["head"].startswith("model output: your layer, float32")
    if loss == "mae":
        assert rows["head/inner"].startswith("model output (loss mean_absolute_error): float16")
        np.testing.assert_allclose(model.predict(X, verbose=0), 128000.0)
    with pytest.raises(AttributeError):
        model.get_layer("head").dense.output


def test_heads_walk_back_through_weightless_layers():
    inputs = keras.Input((4, 2))
    hidden = L.Dense(4, name="hidden")(inputs)
    out = L.Flatten(name="flat")(L.Dense(1, name="reg")(hidden))
    probs = L.Activation("softmax", name="act")(L.Dense(3, name="logits")(hidden))
    model = keras.Model(inputs, [out, probs])
    heads = output_heads.find(model, None)
    assert _bounded(model, heads) == {"flat": False, "reg": False, "act": True, "logits": True}
    seq = keras.Sequential([keras.Input((4,)), L.Dense(2, name="d"), L.Dropout(0.1, name="drop")])
    assert _bounded(seq, output_heads.find(seq, None)) == {"drop": False, "d": False}


def _bounded(model, heads):
    return {
        layer.name: heads.head(layer)
        for layer in model._flatten_layers(include_self=False)
        if heads.head(layer) is not None
    }
