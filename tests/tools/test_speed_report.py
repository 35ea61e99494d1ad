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
    # The column is the rules' decision, whatever the device.
    report = keras_mp.speed_report(model, X, level, dtype, device="H100")
    assert [layer.dtype_policy.name for layer in model.layers] == before  # unchanged
    keras_mp.apply_amp(model, level, dtype)
    summary = {r["layer"]: r["compute_dtype"] for r in keras_mp.precision_summary(model).rows}
    assert report.rows
    for row in report.rows:
        assert row["dtype"] == summary[row["layer"]], row


def test_flops_bytes_and_tensor_cores_by_hand():
    report = keras_mp.speed_report(_classifier(), X, "O2", "float16", device="H100")
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
    report = keras_mp.speed_report(mlp, np.zeros((64, 64), "float32"), "O2", device="H100")
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
    report = keras_mp.speed_report(model, x, "O2", "bfloat16", device="A100")
    summary = report.summary
    assert not summary["launch_bound"]
    assert summary["half_flop_share"] > 0.9
    assert summary["speedup_bound_float32"] > summary["speedup_bound_tf32"] > 1.0
    assert "A100" in report.verdict and "TF32" in report.verdict


@hypothesis.settings(deadline=None, max_examples=15)
@hypothesis.given(
    st.text(max_size=6).filter(
        lambda s: s.upper() not in ("H100", "H200", "A100", "L4", "T4", "CPU")
    )
)
def test_an_unknown_device_is_refused_by_name(device):
    with pytest.raises(ValueError, match=r"`device` must be 'cpu' .* H100, H200, A100, L4, T4"):
        keras_mp.speed_report(_classifier(), X, device=device)
    with pytest.raises(ValueError, match=r"`gpu` must be 'cpu' .* Received: gpu="):
        keras_mp.speed_report(_classifier(), X, gpu=device)


def test_gpu_is_the_older_name_of_device():
    old = keras_mp.speed_report(_classifier(), X, "O2", gpu="A100").summary
    new = keras_mp.speed_report(_classifier(), X, "O2", device="A100").summary
    assert old["gpu"] == new["gpu"] == "NVIDIA A100 SXM 80GB"
    assert old["speedup_bound_tf32"] == new["speedup_bound_tf32"]
    with pytest.raises(ValueError, match="pass one of them"):
        keras_mp.speed_report(_classifier(), X, device="A100", gpu="H100")


def test_without_a_gpu_it_reports_for_this_cpu():
    """Issue 64.2: the default is this machine; without a GPU its CPU, with
    the rates measured here, its bound, what the CPU lacks, and no
    tensor-core advice. Issue 75.5: its launches at what one costs here,
    and a verdict that agrees with them."""
    from keras_mp._src import backends
    from keras_mp._src.backends import cpu_rates
    from keras_mp._src.backends import gpu_peaks

    if backends.current.gpu_name() is not None:
        pytest.skip("this machine has a GPU: the default reports for it")
    model = keras.Sequential(
        [keras.Input((512,)), L.Dense(1000, activation="relu"), L.Dense(250), L.Dense(10)]
    )
    x = keras.KerasTensor((256, 512), "float32")
    for dtype in ("bfloat16", "float16"):
        report = keras_mp.speed_report(model, x, "O2", dtype)
        summary = report.summary
        assert summary["device_kind"] == "cpu" and cpu_rates.cpu_name() in summary["gpu"]
        bound = summary["speedup_bound_tf32"]
        assert bound == summary["speedup_bound_float32"] > 1  # no TF32 on a CPU
        # The rates `fit` multiplies at (float16 is float32 on PyTorch's CPU).
        peaks = gpu_peaks.this_cpu()
        rate = peaks.matmul_rate(dtype) / peaks.float32
        assert f"a {dtype} matmul ran at {rate:.2f}x float32's rate" in report.verdict
        # Its launches at this backend's measured cost a launch at O2 (an
        # emulated dtype's small matmuls make them slow): the verdict says
        # what its own numbers say.
        each = cpu_rates.launch_seconds(dtype)
        assert summary["launch_seconds"] == pytest.approx(summary["kernel_launches"] * each)
        work = summary["step_seconds"]["O2"]
        assert summary["launch_bound"] == (summary["launch_seconds"] > work)
        predicted = summary["predicted_speedup"]
        assert predicted > 0 and f"predicted {predicted:.2f}x" in report.verdict
        if summary["launch_bound"]:
            assert f"with {backends.current.NAME}: expect no speed-up (predicted" in report.verdict
        else:
            assert f"at most {bound:.2f}x" in report.verdict
        lacks = bool(cpu_rates.cpu_flags()) and not cpu_rates.native(cpu_rates.cpu_flags(), dtype)
        assert (f"no native {dtype} instructions" in report.verdict) == lacks
        assert not any(a.startswith("pad ") for a in summary["advice"])
        assert "n/a (CPU)" in report.text
        assert report.summary == keras_mp.speed_report(model, x, "O2", dtype, device="cpu").summary


def test_an_emulated_half_dtype_is_bounded_at_float32s_rate():
    """A CPU that converts bfloat16 to float32 (1 GFLOP/s against 100): the
    bound never charges half below float32; a native one (3x) lifts it."""
    from keras_mp._src.backends import gpu_peaks

    slow = gpu_peaks.Peaks("a CPU", 1e9, 1e9, None, 1e11, 2e10, kind="cpu", native=())
    fast = gpu_peaks.Peaks("a CPU", 3e11, 3e11, None, 1e11, 2e10, kind="cpu", native=("bfloat16",))
    model = keras.Sequential([keras.Input((1024,)), L.Dense(1024), L.Dense(1024)])
    x = keras.KerasTensor((512, 1024), "float32")
    slower = keras_mp.speed_report(model, x, "O2", "bfloat16", device=slow).summary
    faster = keras_mp.speed_report(model, x, "O2", "bfloat16", device=fast).summary
    assert 1.0 < slower["speedup_bound_tf32"] < 2.5  # O0_ATTAINED["cpu"]: 2x at most
    assert "0.01x float32's rate" in slower["verdict"] and "no native bfloat16" in slower["verdict"]
    assert slower["speedup_bound_tf32"] * 1.5 < faster["speedup_bound_tf32"] < 7.0
    assert "no native" not in faster["verdict"]  # judged by the Peaks' own flags
    # O0 against itself: no speed-up, whatever the calibration of float32.
    # (Its strict bound on a GPU is TF32's own gain: O0 with TF32 on, as
    # the backend runs it, against O0 with it off.)
    for device in ("H100", slow):
        same = keras_mp.speed_report(model, x, "O0", "float16", device=device).summary
        assert same["speedup_bound_tf32"] == pytest.approx(1.0)
    assert same["speedup_bound_float32"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="`kind` must be 'gpu' or 'cpu'. Received: kind='CPU'"):
        gpu_peaks.Peaks("a CPU", 1e9, 1e9, None, 1e11, 2e10, kind="CPU")


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
