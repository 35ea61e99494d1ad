"""The work of a layer call, against FLOPs computed by hand from its shapes
(`speed_trace.py`): one symbolic forward pass, every backend."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import speed_trace

L = keras.layers


def _works(model, x):
    calls = speed_trace.trace(model, x)
    works = {}
    for call in calls:
        work = speed_trace.work(call)
        name = call.layer.name
        flops, dims = works.get(name, (0, ()))
        works[name] = (flops + work.flops, work.dims or dims)
    return works


def _model(inputs, *layers, name="m"):
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x, name=name)


def test_dense():
    model = _model(keras.Input((16,)), L.Dense(250, name="d"))
    flops, dims = _works(model, np.zeros((8, 16), "float32"))["d"]
    assert flops == 2 * 8 * 16 * 250
    assert speed_trace.misaligned(dims) == [("units", 250)]


def test_a_dimension_of_256_is_not_flagged():
    model = _model(keras.Input((16,)), L.Dense(256, name="d"))
    _, dims = _works(model, np.zeros((8, 16), "float32"))["d"]
    assert speed_trace.misaligned(dims) == []


def test_conv2d_and_its_transpose():
    model = _model(
        keras.Input((8, 8, 3)),
        L.Conv2D(16, 3, padding="same", name="c"),
        L.Conv2DTranspose(4, 2, strides=2, name="t"),
    )
    works = _works(model, np.zeros((2, 8, 8, 3), "float32"))
    assert works["c"][0] == 2 * 2 * 8 * 8 * 16 * 9 * 3
    assert works["t"][0] == 2 * 2 * 8 * 8 * 4 * 4 * 16  # every input position
    assert speed_trace.misaligned(works["c"][1]) == [("input channels", 3)]


def test_einsum_dense_is_one_gemm():
    layer = L.EinsumDense("abc,cde->abde", output_shape=(None, 2, 12), name="e")
    flops, dims = _works(_model(keras.Input((5, 24)), layer), np.zeros((2, 5, 24), "float32"))["e"]
    assert flops == 2 * 2 * 5 * 24 * 2 * 12
    assert dict(dims) == {"contracted": 24, "output": 24}  # two heads of 12: one N of 24


def test_multi_head_attention_and_its_projections():
    inputs = keras.Input((6, 16))
    attention = L.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")
    model = keras.Model(inputs, attention(inputs, inputs))
    works = _works(model, np.zeros((2, 6, 16), "float32"))
    assert works["mha"][0] == 2 * 2 * 2 * 6 * 6 * (8 + 8)  # scores and the weighted sum
    projections = sum(f for name, (f, _) in works.items() if name != "mha")
    assert projections == 4 * (2 * 2 * 6 * 16 * 2 * 8)  # query, key, value, output


def test_lstm_counts_its_gates_over_the_sequence():
    model = _model(keras.Input((5, 4)), L.LSTM(8, name="lstm"))
    flops, dims = _works(model, np.zeros((2, 5, 4), "float32"))["lstm"]
    assert flops == 2 * 2 * 5 * (4 + 8) * 4 * 8
    assert speed_trace.misaligned(dims) == [("input features", 4)]


def test_a_keras_hub_gemma_block():
    """A GemmaDecoderBlock: query, key and value projections (grouped), the
    attention's scores and sum, its output, and the gated MLP (two
    projections to intermediate_dim / 2 and one back)."""
    keras_hub = pytest.importorskip("keras_hub")
    b, t, hidden, heads, kv, head_dim, intermediate = 2, 8, 32, 2, 1, 16, 64
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=heads,
        num_key_value_heads=kv,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        head_dim=head_dim,
    )
    x = {"token_ids": np.ones((b, t), "int32"), "padding_mask": np.ones((b, t), "int32")}
    calls = speed_trace.trace(backbone, x)
    block = backbone.get_layer("decoder_block_0")
    inside = {id(layer) for layer in block._flatten_layers()}
    flops = sum(speed_trace.work(c).flops for c in calls if id(c.layer) in inside)
    expected = (
        2 * b * t * hidden * heads * head_dim  # query
        + 2 * 2 * b * t * hidden * kv * head_dim  # key, value
        + 2 * b * heads * t * t * 2 * head_dim  # scores, weighted sum
        + 2 * b * t * heads * head_dim * hidden  # output
        + 3 * 2 * b * t * hidden * (intermediate // 2)  # gating, gating_2, linear
    )
    assert flops == expected


def test_the_trace_changes_nothing_of_the_model():
    model = _model(keras.Input((16,)), L.Dense(8, name="d"))
    own = dict(model.get_layer("d").__dict__)
    speed_trace.trace(model, np.zeros((2, 16), "float32"))
    assert "call" not in model.get_layer("d").__dict__ or own.get("call") is not None
    assert set(model.get_layer("d").__dict__) == set(own)
