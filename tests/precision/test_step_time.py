"""A step's predicted time (`step_time.py`): its parts against arithmetic
done here, the launches it counts against the proxy the CPU's launch cost
is measured on, and the batch `amp_level="auto"` predicts for. No timing."""

import keras
import numpy as np
import pytest

from keras_mp._src.backends import cpu_rates
from keras_mp._src.backends import gpu_peaks
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost
from keras_mp._src.precision import step_time

L = keras.layers

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="a symbolic pass and arithmetic on its shapes: the PyTorch suite checks them",
)

CPU = gpu_peaks.Peaks(
    "a CPU",
    float16=1e11,
    bfloat16=4e11,
    tf32=None,
    float32=1e11,
    bandwidth=2e10,
    kind="cpu",
    native=("bfloat16",),
    launch={"float32": 2e-5, "bfloat16": 3e-5},
    elementwise={"float32": 1e9, "bfloat16": 2e9},
)


def _accounts(model, batch, level):
    calls = speed_trace.trace(model, keras.KerasTensor((batch, 64), "float32"))
    return step_cost.accounts_at(model, calls, amp_settings.for_layers(level, "bfloat16"))


def test_a_cpu_step_is_the_sum_of_its_parts_by_hand():
    model = keras.Sequential([keras.Input((64,)), L.Dense(32), L.Dense(8)])
    o2 = step_time.step_time(model, _accounts(model, 16, "O2"), CPU, "bfloat16", slots=2)
    # The first Dense's matmuls: forward and the weights' gradient (its
    # input is the model's); the second's three.
    flops = 2 * 2 * 16 * 64 * 32 + 3 * 2 * 16 * 32 * 8
    assert o2.matmuls == pytest.approx(flops / 4e11)
    assert o2.other == pytest.approx(3 * (16 * 32 + 16 * 8) / 2e9)
    weights = 64 * 32 + 32 + 32 * 8 + 8
    assert o2.update == pytest.approx(weights * (3 + 2 * 2) / 1e9)
    # Each layer 3, each variable 1, and the casts: the kernels and biases,
    # the model's input, the float32 output, forward and back.
    assert o2.launches == 2 * 3 + 4 + 2 * (4 + 1 + 1)
    assert o2.casts == pytest.approx(2 * (weights + 16 * 64 + 16 * 8) / 2e9)
    assert o2.seconds == pytest.approx(o2.work + o2.launches * 3e-5)
    o0 = step_time.step_time(model, _accounts(model, 16, "O0"), CPU, "float32", slots=2)
    assert o0.casts == 0 and o0.launches == 10 and o0.per_launch == 2e-5


def test_a_gpu_hides_its_launches_behind_its_work():
    model = keras.Sequential([keras.Input((64,)), L.Dense(32), L.Dense(8)])
    h100 = gpu_peaks.peaks_of("H100")
    step = step_time.step_time(model, _accounts(model, 16, "O2"), h100, "float16")
    assert step.per_launch == gpu_peaks.LAUNCH_SECONDS and step.kind == "gpu"
    assert step.launch_bound and step.seconds == step.launch_seconds > step.work


@pytest.mark.parametrize("dtype, key", [("float32", "float32"), ("bfloat16", "half")])
def test_the_proxy_launches_what_its_launch_cost_is_divided_by(dtype, key):
    """`cpu_rates.launch_seconds` is the proxy's step over its launches as
    `step_time.launches` counts them."""
    proxy = cpu_rates.proxy_model()
    calls = speed_trace.trace(proxy, keras.KerasTensor((8, cpu_rates.PROXY_WIDTH), "float32"))
    level = "O0" if dtype == "float32" else "O2"
    accounts = step_cost.accounts_at(proxy, calls, amp_settings.for_layers(level, "bfloat16"))
    assert step_time.launches(proxy, accounts) == cpu_rates.PROXY_LAUNCHES[key]


def test_the_batch_auto_predicts_for():
    mlp = keras.Sequential([keras.Input((64,)), L.Dense(8)])
    batch, words = step_time.synthetic_batch(mlp)
    assert batch.shape == (32, 64) and "batch 32" in words and "128" not in words
    ids = keras.Input((None,), dtype="int32", name="ids")
    mask = keras.Input((None,), dtype="int32", name="mask")
    text = keras.Model({"ids": ids, "mask": mask}, L.Embedding(10, 4)(ids))
    batch, words = step_time.synthetic_batch(text)
    assert batch["ids"].shape == (32, 128) and batch["ids"].dtype == "int32"
    assert "128 for the lengths it leaves open" in words

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(4)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    assert step_time.synthetic_batch(model) == (
        None,
        "its inputs are not known at compile (build it on a batch first)",
    )
    model(np.zeros((2, 6), "float32"))  # built on a batch of 2
    assert step_time.synthetic_batch(model)[0].shape == (32, 6)


def test_a_tied_head_is_priced_as_the_target_cpu_multiplies_it(monkeypatch):
    """A tied head's float32 table, read in float32 where the CPU priced has
    no native bfloat16 (`cpu_rates.tables_in_half`), at float32's rate; with
    native bfloat16, or `KERAS_MP_TIED_HEAD=half`, at bfloat16's."""
    import dataclasses

    monkeypatch.setenv("KERAS_MP_TIED_HEAD", "auto")
    table = L.ReversibleEmbedding(32, 64)
    tokens = keras.Input((4,), dtype="int32")
    backbone = keras.Model(tokens, L.Dense(64)(table(tokens)))
    model = keras.Model(tokens, table(backbone(tokens), reverse=True))
    calls = speed_trace.trace(model, keras.KerasTensor((16, 4), "int32"))
    accounts = step_cost.accounts_at(model, calls, amp_settings.for_layers("O2", "bfloat16"))
    (head,) = [a.step_flops for a in accounts.values() if a.layer is table]
    total = sum(a.step_flops for a in accounts.values())
    assert head >= 2 * 2 * 16 * 4 * 64 * 32  # its forward and its table's gradient
    plain = dataclasses.replace(CPU, native=())
    seconds = {
        peaks.native: step_time.step_time(model, accounts, peaks, "bfloat16").matmuls
        for peaks in (CPU, plain)
    }
    assert seconds[("bfloat16",)] == pytest.approx(total / 4e11)
    assert seconds[()] == pytest.approx(head / 1e11 + (total - head) / 4e11)
    monkeypatch.setenv("KERAS_MP_TIED_HEAD", "half")
    assert step_time.step_time(model, accounts, plain, "bfloat16").matmuls == pytest.approx(
        total / 4e11
    )
