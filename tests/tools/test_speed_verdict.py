"""What the speed report's numbers mean (`speed_verdict.py`): a step its
launches dominate is reported as such on a CPU as on a GPU, the bound
after it; the bound first where the work dominates. No timing: the CPUs
are `Peaks` of given rates."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.backends import gpu_peaks

L = keras.layers

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="the verdict reads the report's numbers, not the backend: PyTorch checks it",
)


def _cpu(**known):
    """A CPU with AVX512-BF16: a bfloat16 matmul 2.5x float32's rate."""
    return gpu_peaks.Peaks(
        "a CPU with AVX512-BF16", 2e11, 5e11, None, 2e11, 2e10, kind="cpu",
        native=("bfloat16",), **known,
    )  # fmt: skip


MEASURED = dict(
    launch={"float32": 3e-5, "bfloat16": 4.5e-5},
    elementwise={"float32": 1e9, "bfloat16": 1e9},
)


def _digits_mlp():
    return keras.Sequential(
        [
            keras.Input((64,)),
            L.Dense(256, activation="relu"),
            L.BatchNormalization(),
            L.Dense(256, activation="relu"),
            L.Dense(10, activation="softmax"),
        ]
    )


def test_a_cpu_step_its_launches_dominate_is_reported_so():
    """Issue 75.5: the digits MLP at O2 bfloat16 on a CPU whose bfloat16
    matmul runs 2.5x float32's: its launches exceed its modelled work, so
    the verdict says to expect no speed-up, with the prediction, and the
    bound ("at most") only after them; a larger batch is the advice."""
    x = np.zeros((32, 64), "float32")
    report = keras_mp.speed_report(_digits_mlp(), x, "O2", "bfloat16", device=_cpu(**MEASURED))
    summary = report.summary
    assert summary["launch_seconds"] > summary["step_seconds"]["O2"]
    assert summary["launch_bound"] and summary["predicted_speedup"] < 1
    head, tail = report.verdict.split("; ", 1)
    assert head.startswith(
        "O2 bfloat16 on a CPU with AVX512-BF16: expect no speed-up (predicted 0."
    )
    assert "at most" not in head and "would give at most" in tail
    assert f"{summary['kernel_launches']} launches" in head and "45 us each" in head
    assert summary["advice"][0].startswith("a larger batch")
    assert report.verdict in str(report)


def test_a_step_its_work_dominates_leads_with_the_bound():
    model = keras.Sequential([keras.Input((1024,)), L.Dense(1024), L.Dense(1024)])
    x = keras.KerasTensor((512, 1024), "float32")
    summary = keras_mp.speed_report(model, x, "O2", "bfloat16", device=_cpu(**MEASURED)).summary
    assert not summary["launch_bound"] and summary["predicted_speedup"] > 1
    bound = summary["speedup_bound_tf32"]
    assert summary["verdict"].startswith(
        "O2 bfloat16 on a CPU with AVX512-BF16: a bfloat16 matmul ran at 2.50x float32's "
        f"rate here; at most {bound:.2f}x the float32 step (predicted "
    )
    # A CPU of one's own without its launch cost: no prediction, no warning.
    unknown = keras_mp.speed_report(model, x, "O2", "bfloat16", device=_cpu()).summary
    assert unknown["launch_seconds"] == 0 and not unknown["launch_bound"]
    assert unknown["predicted_speedup"] is None and "predicted" not in unknown["verdict"]
    assert unknown["speedup_bound_tf32"] == bound  # the bound does not depend on them


@pytest.mark.parametrize("device", ["H100", "T4", "cpu facts"])
def test_the_verdict_agrees_with_the_reports_own_numbers(device):
    device = _cpu(**MEASURED) if device == "cpu facts" else device
    for batch in (32, 8192):
        x = keras.KerasTensor((batch, 64), "float32")
        summary = keras_mp.speed_report(_digits_mlp(), x, "O2", "bfloat16", device=device).summary
        bound = summary["launch_seconds"] > summary["step_seconds"]["O2"]
        assert summary["launch_bound"] == bound
        predicted = summary["predicted_speedup"]
        slower = predicted is None or predicted < 1
        assert ("expect no speed-up" in summary["verdict"]) == (bound and slower)
        assert ("expect little speed-up" in summary["verdict"]) == (bound and not slower)
