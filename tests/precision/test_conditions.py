"""The conditions the rules ask of a layer and its place (`Place`)."""

import keras

from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import conditions
from keras_mp._src.precision import float8

L = keras.layers


def _place(half="float16", **where):
    return conditions.Place(amp_settings.for_layers("O2", half), None, **where)


def test_may_overflow_float16_needs_an_unbounded_head_without_a_cross_entropy():
    dense = L.Dense(1)
    overflows = conditions.may_overflow_float16
    assert overflows(dense, _place(head=False))
    assert overflows(dense, _place(head=False, loss=("mean_squared_error", False)))
    assert not overflows(dense, _place(head=False, loss=("binary_crossentropy", True)))
    assert not overflows(dense, _place(head=True))  # a bounded activation on its way out
    assert not overflows(dense, _place(head=None))  # not a head
    assert not overflows(dense, _place("bfloat16", head=False))
    assert conditions.is_head(dense, _place(head=False)) and conditions.is_head(
        dense, _place(head=True)
    )
    assert not conditions.is_head(dense, _place())


def test_heads_walk_back_through_weightless_layers():
    inputs = keras.Input((4, 2))
    hidden = L.Dense(4, name="hidden")(inputs)
    out = L.Flatten(name="flat")(L.Dense(1, name="reg")(hidden))
    probs = L.Activation("softmax", name="act")(L.Dense(3, name="logits")(hidden))
    model = keras.Model(inputs, [out, probs])
    outputs = (model.get_layer("flat"), model.get_layer("act"))
    heads = {
        model.get_layer(n).name: b for n, b in _named(model, float8.head_layers(model, outputs))
    }
    assert heads == {"flat": False, "reg": False, "act": True, "logits": True}
    seq = keras.Sequential([keras.Input((4,)), L.Dense(2, name="d"), L.Dropout(0.1, name="drop")])
    heads = dict(_named(seq, float8.head_layers(seq, (seq.get_layer("drop"),))))
    assert heads == {"drop": False, "d": False}


def _named(model, heads):
    by_id = {id(layer): layer for layer in model._flatten_layers(include_self=False)}
    return [(by_id[i].name, bounded) for i, (_, bounded) in heads.items()]
