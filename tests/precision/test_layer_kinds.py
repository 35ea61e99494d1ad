"""What kind of layer a layer is, as the rules ask: by class (`isinstance`,
subclasses too), by a library class named by its path, by naming convention."""

import keras
import pytest

from keras_mp._src.precision import layer_kinds

pytestmark = pytest.mark.one_backend


class RMSNorm(keras.layers.Layer):  # a user's, named by the convention
    pass


class MyExpertsMoeBlock(keras.layers.Layer):
    num_experts = 4


def test_normalizations_by_class_and_by_name():
    assert layer_kinds.is_normalization(keras.layers.LayerNormalization())
    assert layer_kinds.is_normalization(RMSNorm())
    assert not layer_kinds.is_normalization(keras.layers.Dense(2))


def test_attention_is_keras_s_or_a_library_s_not_yours():
    class MyAttention(keras.layers.Layer):
        pass

    assert layer_kinds.is_attention(keras.layers.MultiHeadAttention(2, 4))
    assert not layer_kinds.is_attention(MyAttention())  # your own: its own rules


def test_routers_and_expert_blocks():
    block = MyExpertsMoeBlock()
    assert layer_kinds.routes_experts(block)
    assert layer_kinds.is_router(keras.layers.Dense(4), block)  # one logit per expert
    assert not layer_kinds.is_router(keras.layers.Dense(8), block)
    assert not layer_kinds.is_router(keras.layers.Dense(4), None)


def test_matches_takes_classes_names_and_layers():
    dense = keras.layers.Dense(2, name="probe")
    assert layer_kinds.matches(dense, [keras.layers.Dense])
    assert layer_kinds.matches(dense, ["probe"])
    assert layer_kinds.matches(dense, [dense])
    assert not layer_kinds.matches(dense, [keras.layers.Conv2D, "other", keras.layers.Dense(2)])


def test_of_class_and_a_layer_s_own_dtype():
    is_conv = layer_kinds.of_class(keras.layers.Conv1D, keras.layers.Conv2D)
    assert is_conv(keras.layers.Conv2D(2, 3)) and not is_conv(keras.layers.Dense(2))
    assert layer_kinds.computes_no_float(keras.layers.Hashing(8))
    assert not layer_kinds.computes_no_float(keras.layers.Dense(2))


def test_a_library_class_matches_by_isinstance_not_by_its_name():
    pytest.importorskip("keras_hub")
    from keras_hub.src.models.t5.t5_multi_head_attention import T5MultiHeadAttention

    class Own(T5MultiHeadAttention):  # a subclass matches
        pass

    class T5MultiHeadAttention2(keras.layers.Layer):  # a name alike does not
        pass

    T5MultiHeadAttention2.__name__ = "T5MultiHeadAttention"
    kwargs = dict(
        is_decoder=False,
        hidden_dim=8,
        key_value_dim=4,
        num_heads=2,
        dropout=0.0,
        use_relative_attention_bias=False,
    )
    assert layer_kinds.MASKS_WITH_1E9(T5MultiHeadAttention(**kwargs))
    assert layer_kinds.MASKS_WITH_1E9(Own(**kwargs))
    assert not layer_kinds.MASKS_WITH_1E9(T5MultiHeadAttention2())
    missing = layer_kinds.of_library_class("keras_hub.src.models.nowhere.Nothing")
    assert not missing(keras.layers.Dense(2))  # a class this version lacks
