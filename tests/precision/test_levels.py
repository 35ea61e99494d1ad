"""The level table, layer kind by layer kind, as the README states it.

One model with a layer of every kind the table names; each level and half
dtype is applied through the public API (`apply_amp`, `compile`) and every
layer's compute and variable dtypes, and the loss scaling, are compared with
the table below, written out from the README rather than from the code.
"""

import keras
import pytest

import keras_mp

pytestmark = pytest.mark.one_backend

HALF = "half"
F32 = "float32"

# kind: (compute, variables) per level; "half" is the level's half dtype.
# An output layer computes as its kind does at the level (the head is a
# Dense whose logits a softmax reads) and returns float32; a layer that
# only computes probabilities (a Softmax) is float32 at every level,
# wherever it sits.
TABLE = {
    "O0": {"allow": (F32, F32), "other": (F32, F32), "norm": (F32, F32), "probs": (F32, F32)},
    "O1": {"allow": (HALF, F32), "other": (F32, F32), "norm": (F32, F32), "probs": (F32, F32)},
    "O2": {"allow": (HALF, F32), "other": (HALF, F32), "norm": (F32, F32), "probs": (F32, F32)},
    "O3": {
        "allow": (HALF, HALF),
        "other": (HALF, HALF),
        "norm": (HALF, HALF),
        "probs": (F32, F32),
    },
}
# The loss scale `compile` sets up: float16 at O1 and O2 only.
LOSS_SCALED = {"O0": False, "O1": True, "O2": True, "O3": False}

KINDS = {
    "dense": "allow",  # Dense is on the allow-list
    "conv": "allow",
    "add": "other",  # on neither list
    "embedding_like": "allow",  # a Dense too
    "batch_norm": "norm",  # the deny-list
    "layer_norm": "norm",
    "softmax": "probs",  # a Softmax inside the model
    "head": "allow",  # an output layer
    "probs": "probs",  # an output layer that is a Softmax
}


def _model():
    inputs = keras.Input((8, 4))
    x = keras.layers.Conv1D(4, 3, padding="same", name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="batch_norm")(x)
    y = keras.layers.Dense(4, name="dense")(x)
    x = keras.layers.Add(name="add")([x, y])
    x = keras.layers.LayerNormalization(name="layer_norm")(x)
    x = keras.layers.Dense(4, name="embedding_like", use_bias=False)(x)
    x = keras.layers.Softmax(name="softmax")(x)
    x = keras.layers.Flatten()(x)
    logits = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, [logits, keras.layers.Softmax(name="probs")(logits)])


def _expected(level, half, kind):
    compute, variables = TABLE[level][kind]
    return (half if compute == HALF else compute), (half if variables == HALF else variables)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_every_kind_of_layer_follows_the_table(level, half):
    model = _model()
    keras_mp.apply_amp(model, level, half)
    for name, kind in KINDS.items():
        layer = model.get_layer(name)
        compute, variables = _expected(level, half, kind)
        assert layer.compute_dtype == compute, (name, layer.dtype_policy.name)
        for weight in layer.weights:
            assert weight.dtype == variables, (name, weight.path)
    # The outputs leave in float32, whatever the head computes in.
    outputs = model(keras.ops.ones((2, 8, 4)))
    assert [keras.backend.standardize_dtype(y.dtype) for y in outputs] == ["float32"] * 2


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_compile_sets_up_loss_scaling_as_the_table_says(level, half):
    model = _model()
    model.compile(optimizer="sgd", loss="mse", amp_level=level, amp_dtype=half)
    wrapped = isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    scaled = wrapped and model.optimizer.dynamic
    assert scaled == (LOSS_SCALED[level] and half == "float16")
    # Every half level is wrapped: where it scales no loss, in a fixed
    # scale of 1 that skips a non-finite step (and at O3 holds the float32
    # master weights of the half variables).
    assert wrapped == (level != "O0")
    if wrapped and not scaled:
        assert model.optimizer.initial_scale == 1.0 and model.optimizer.master_weights
        assert model.optimizer.config.checks_finite
    assert model.get_compile_config()["amp_level"] == level


def test_o3_keeps_batchnorm_in_float32_when_asked():
    model = _model()
    keras_mp.apply_amp(model, "O3", "float16", keep_batchnorm_fp32=True)
    bn = model.get_layer("batch_norm")
    assert bn.compute_dtype == "float32"
    assert {w.dtype for w in bn.weights} == {"float32"}
    assert model.get_layer("layer_norm").compute_dtype == "float16"
