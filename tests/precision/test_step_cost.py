"""What a level costs a step (`step_cost.py`): a layer's roofline and its
casts, against arithmetic done here."""

import keras
import numpy as np

from keras_mp._src.backends import gpu_peaks
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost


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


def test_a_big_matmul_is_bound_by_its_flops_a_small_one_by_its_bytes():
    peaks = gpu_peaks.peaks_of("H100")
    for batch, bound_by in ((4096, "flops"), (8, "bytes")):
        model = _model(4096)
        _, accounts = _accounts(model, batch, "O2")
        (entry,) = [a for a in accounts.values() if a.layer.name == "d"]
        # `d` takes the model's inputs: its input gradient is never
        # computed (2 matmuls a step per forward one, not 3).
        assert entry.step_flops == 2 * entry.flops
        flops_s = 2 * entry.flops / peaks.matmul_rate("float16")
        bytes_s = entry.moved / peaks.bandwidth
        assert step_cost.layer_seconds(entry, peaks, tf32=True) == max(flops_s, bytes_s)
        assert (flops_s > bytes_s) == (bound_by == "flops"), (batch, flops_s, bytes_s)


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


def test_a_tied_head_computes_its_inputs_gradient_though_its_lookup_is_first():
    """The embedding takes the model's ids (a first layer: no input
    gradient) and, reversed, the hidden states, whose gradient its logits'
    backward computes: 3 matmuls a step per forward one, not 2."""
    keras.utils.set_random_seed(0)
    table = keras.layers.ReversibleEmbedding(32, 8, name="token_embedding")
    tokens = keras.Input((6,), dtype="int32")
    model = keras.Model(tokens, table(keras.layers.Dense(8)(table(tokens)), reverse=True))
    calls = speed_trace.trace(model, np.zeros((4, 6), "int32"))
    accounts = step_cost.accounts_at(model, calls, amp_settings.for_layers("O2", "bfloat16"))
    (head,) = [a for a in accounts.values() if a.layer is table]
    assert head.flops == 2 * 4 * 6 * 8 * 32
    assert head.step_flops == 3 * head.flops


def test_a_first_layer_after_a_weightless_one_computes_no_input_gradient():
    """A Flatten before the first Dense makes no features: its output is
    still the model's input, whose gradient nothing computes (2 matmuls a
    step per forward one, not 3)."""
    model = keras.Sequential(
        [keras.Input((2, 4)), keras.layers.Flatten(), keras.layers.Dense(4, name="d")]
    )
    calls = speed_trace.trace(model, np.zeros((2, 2, 4), "float32"))
    accounts = step_cost.accounts_at(model, calls, amp_settings.for_layers("O2", "bfloat16"))
    (entry,) = [a for a in accounts.values() if a.layer.name == "d"]
    assert entry.step_flops == 2 * entry.flops
