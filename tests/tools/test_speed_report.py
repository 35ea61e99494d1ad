"""`speed_report`: the dtypes of the rules, bytes computed by hand and by a
real optimizer, the launch warning, the bound, and bad input. No timings."""

import hypothesis
import hypothesis.strategies as st
import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers


def _classifier(name="clf"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = L.Conv2D(16, 3, padding="same", name="conv")(inputs)
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(x)
    x = L.Flatten(name="flatten")(x)
    x = L.Dense(250, name="hidden")(x)
    outputs = L.Dense(10, name="logits")(x)
    model = keras.Model(inputs, outputs, name=name)
    # Its logits read by a cross-entropy: the head computes in half.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


X = np.zeros((64, 8, 8, 1), "float32")


@pytest.mark.parametrize(
    "level, dtype",
    [("O1", "float16"), ("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")],
)
def test_the_dtype_column_is_what_apply_amp_sets(level, dtype):
    model = _classifier()
    before = [layer.dtype_policy.name for layer in model.layers]
    report = keras_mp.speed_report(model, X, level, dtype)
    assert [layer.dtype_policy.name for layer in model.layers] == before  # unchanged
    keras_mp.apply_amp(model, level, dtype)
    summary = {r["layer"]: r["compute_dtype"] for r in keras_mp.precision_summary(model).rows}
    assert report.rows
    for row in report.rows:
        assert row["dtype"] == summary[row["layer"]], row


def test_flops_bytes_and_tensor_cores_by_hand():
    report = keras_mp.speed_report(_classifier(), X, "O2", "float16")
    rows = {r["layer"]: r for r in report.rows}
    assert rows["hidden"]["flops"] == 3 * 2 * 64 * (8 * 8 * 16) * 250
    assert rows["hidden"]["tensor_cores"] == "no: units=250"
    assert rows["conv"]["tensor_cores"] == "no: input channels=1"
    # The model's output layer: in half, and as misaligned as `hidden`.
    assert rows["logits"]["tensor_cores"] == "no: input features=250, units=10"
    # conv takes float32 inputs, and its float32 kernel and bias, in float16:
    # each cast forward, and its gradient back.
    assert rows["conv"]["casts"] == 3 * 2
    assert rows["conv"]["cast_bytes"] == 2 * (64 * 64 + 3 * 3 * 16 + 16) * (4 + 2)
    params = (3 * 3 * 16 + 16) + 4 * 16 + (1024 * 250 + 250) + (250 * 10 + 10)
    trainable = params - 2 * 16  # BatchNorm's moving mean and variance
    b = report.summary["bytes"]
    assert b["O0"]["weights"] == b["O2"]["weights"] == 4 * params
    assert b["O2"]["optimizer"] == 2 * 4 * trainable  # Adam's two float32 slots
    assert any(
        a.startswith("pad units=250 -> 256 (Dense)") and "at `hidden`" in a
        for a in report.summary["advice"]
    ), report.summary["advice"]
    o3 = keras_mp.speed_report(_classifier(), X, "O3", "bfloat16").summary["bytes"]["O3"]
    assert o3["weights"] == 2 * params  # the output layer's too


def test_o3_and_zero_optimizer_bytes_are_a_real_optimizers():
    """O3: Adam's float32 slots and a float32 master copy of each half weight,
    as a LossScaleOptimizer built on the O3 model holds them; ZeRO-1 divides
    them over the replicas."""
    model = _classifier()
    report = keras_mp.speed_report(model, X, "O3", "bfloat16")
    sharded = keras_mp.speed_report(
        model, X, "O3", "bfloat16", replicas=4, shard_optimizer_state=True
    )
    keras_mp.apply_amp(model, "O3", "bfloat16")
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), dynamic=False, initial_scale=1)
    optimizer.build(model.trainable_variables)
    real = sum(
        np.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in optimizer.variables
        if len(v.shape)
    )
    assert report.summary["bytes"]["O3"]["optimizer"] == real
    assert sharded.summary["bytes"]["O3"]["optimizer"] == real // 4


def test_the_digits_mlp_is_too_small_to_speed_up():
    keras.utils.set_random_seed(0)
    mlp = keras.Sequential([keras.Input((64,)), L.Dense(64, activation="relu"), L.Dense(10)])
    report = keras_mp.speed_report(mlp, np.zeros((64, 64), "float32"), "O2")
    assert report.summary["launch_bound"]
    assert "expect no speed-up" in report.verdict
    assert report.summary["advice"][0].startswith("a larger batch")
    assert report.verdict in str(report)


def test_a_convolutional_step_is_not_launch_bound_and_gains_in_half():
    """Big activations: the bound comes from bytes and tensor-core FLOPs."""
    inputs = keras.Input((224, 224, 64))
    x = inputs
    for i in range(3):
        x = L.Conv2D(64, 3, padding="same", activation="relu", name=f"c{i}")(x)
    model = keras.Model(inputs, L.Conv2D(8, 1, name="head")(x))
    x = keras.KerasTensor((64, 224, 224, 64), "float32")
    report = keras_mp.speed_report(model, x, "O2", "bfloat16", gpu="A100")
    summary = report.summary
    assert not summary["launch_bound"]
    assert summary["half_flop_share"] > 0.9
    assert summary["speedup_bound_float32"] > summary["speedup_bound_tf32"] > 1.0
    assert "A100" in report.verdict and "TF32" in report.verdict


@hypothesis.settings(deadline=None, max_examples=15)
@hypothesis.given(
    st.text(max_size=6).filter(lambda s: s.upper() not in ("H100", "H200", "A100", "L4", "T4"))
)
def test_an_unknown_gpu_is_refused_by_name(gpu):
    with pytest.raises(ValueError, match=r"`gpu` must be one of H100, H200, A100, L4, T4"):
        keras_mp.speed_report(_classifier(), X, gpu=gpu)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"level": "O4"}, "level"),
        ({"dtype": "float8e4"}, "dtype"),
        ({"level": "O1", "dtype": "float8"}, "dtype='float8'` needs `level`"),
        ({"level": "O2", "dtype": 16}, "dtype"),
    ],
)
def test_bad_levels_and_dtypes_are_refused_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        keras_mp.speed_report(_classifier(), X, **kwargs)
