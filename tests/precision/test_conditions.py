"""The conditions the rules ask of a layer and its place (`Place`)."""

import keras
import pytest

from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import conditions

pytestmark = pytest.mark.one_backend

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
