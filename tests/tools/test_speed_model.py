"""The speed report's model of a step (`speed_model.py`): a layer's roofline
and the step's bytes, against arithmetic done here."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import amp_settings
from keras_mp._src.tools import gpu_peaks
from keras_mp._src.tools import speed_model
from keras_mp._src.tools import speed_trace

pytestmark = pytest.mark.one_backend


def _model(units):
    """A hidden Dense `d` and an output Dense (both half at O2/O3; the
    output returns float32)."""
    model = keras.Sequential(
        [keras.Input((1024,)), keras.layers.Dense(units, name="d"), keras.layers.Dense(8)],
        name="s",
    )
    # Logits read by a cross-entropy: the head computes in half.
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _accounts(model, batch, level, dtype="float16"):
    calls = speed_trace.trace(model, np.zeros((batch, 1024), "float32"))
    amp = amp_settings.for_layers(level, dtype)
    return amp, speed_model.accounts_at(model, calls, amp)


def test_a_big_matmul_is_bound_by_its_flops_a_small_one_by_its_bytes():
    peaks = gpu_peaks.peaks_of("H100")
    for batch, bound_by in ((4096, "flops"), (8, "bytes")):
        model = _model(4096)
        _, accounts = _accounts(model, batch, "O2")
        (entry,) = [a for a in accounts.values() if a.layer.name == "d"]
        # `d` takes the model's inputs: its input gradient is never
        # computed (2 matmuls a step per forward one, not 3).
        assert entry.passes == 2
        flops_s = 2 * entry.flops / peaks.matmul_rate("float16")
        bytes_s = entry.moved / peaks.bandwidth
        assert speed_model.layer_seconds(entry, peaks, tf32=True) == max(flops_s, bytes_s)
        assert (flops_s > bytes_s) == (bound_by == "flops"), (batch, flops_s, bytes_s)


def test_memory_counts_weights_slots_and_master_copies():
    model = _model(256)
    hidden, out = 1024 * 256 + 256, 256 * 8 + 8
    for level, hidden_weight, hidden_state in (("O0", 4, 2 * 4), ("O3", 2, 2 * 4 + 4)):
        amp, accounts = _accounts(model, 8, level, "bfloat16")
        got = speed_model.memory(model, amp, 2, 1, False, accounts)
        assert got["weights"] == hidden_weight * (hidden + out)
        assert got["optimizer"] == hidden_state * (hidden + out)
        half = 4 if level == "O0" else 2
        assert got["activations"] == 8 * 256 * half + 8 * 8 * half
        sharded = speed_model.memory(model, amp, 2, 4, True, accounts)
        assert sharded["optimizer"] == got["optimizer"] // 4


def test_the_output_layer_computes_in_half_and_returns_float32():
    """Its matmul at the half rate, and its outputs cast to float32 on the
    way out: the cast forward and its gradient back."""
    _, accounts = _accounts(_model(256), 8, "O2")
    (out,) = [a for a in accounts.values() if a.layer.name not in ("d", "s")]
    assert out.dtype == "float16"
    weights = 256 * 8 + 8  # its float32 kernel and bias, cast to float16
    inputs = 0  # `d`'s float16 outputs: no cast
    outputs = 8 * 8  # float16 -> float32
    assert out.cast_bytes == 2 * (weights + inputs + outputs) * (4 + 2)
