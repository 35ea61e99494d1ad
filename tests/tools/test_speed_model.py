"""The speed report's model of a step (`speed_model.py`): the step's bytes,
against arithmetic done here."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost
from keras_mp._src.tools import speed_model

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
    return amp, step_cost.accounts_at(model, calls, amp)


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
