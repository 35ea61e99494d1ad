"""`precision_summary`: every layer, its dtypes and the rule that set them,
in the order the model runs; the optimizers the model holds."""

import keras
import numpy as np
import pytest

import keras_mp
from tests import models

pytestmark = pytest.mark.one_backend

NAMES = ["conv", "bn", "relu", "flatten", "hidden", "ln", "logits", "probs"]


def test_precision_summary_rows_and_text():
    model = keras_mp.apply_amp(models.small_cnn(), "O2")
    summary = keras_mp.precision_summary(model)
    rows = {r["layer"].split("/")[-1]: r for r in summary.rows}
    assert rows["bn"]["compute_dtype"] == "float32"
    # Its consumers compute in float16: it hands them float16 in the model's run.
    assert rows["bn"]["rule"] == "O2 deny-list; returns float16 to its float16 consumers in cnn"
    assert rows["ln"]["rule"] == "O2 deny-list; returns float16 to its float16 consumers in cnn"
    assert rows["conv"]["compute_dtype"] == "float16"
    assert rows["conv"]["variable_dtype"] == "float32"
    assert rows["probs"]["rule"] == "probabilities in float32"
    assert rows["probs"]["compute_dtype"] == "float32"
    for name in NAMES:
        assert name in summary.text
    printed = []
    keras_mp.precision_summary(model, print_fn=printed.append)
    assert printed == [summary.text] == [str(summary)] == [repr(summary)]


def test_precision_summary_lists_nested_layers_in_their_order():
    """Top to bottom as the model runs, a nested model's layers under it
    (Keras's recursive layer walk lists them last to first)."""
    inner = keras.Sequential(
        [keras.layers.Dense(4, name="first"), keras.layers.ReLU(name="second")], name="inner"
    )

    class Outer(keras.Model):
        def __init__(self):
            super().__init__(name="outer")
            self.inner = inner
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.inner(x))

    model = Outer()
    model(np.ones((1, 3), "float32"))
    rows = keras_mp.precision_summary(keras_mp.apply_amp(model, "O2")).rows
    names = [r["layer"].split("/")[-1] for r in rows if r["class"] != "InputLayer"]
    assert names == ["outer", "inner", "first", "second", "head"]
