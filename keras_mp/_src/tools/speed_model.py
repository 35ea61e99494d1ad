"""The speed report's model of a step beyond the layers' accounts
(`precision/step_cost.py`): the optimizer's slots, the step's memory
(`memory`), and its time on a device as a roofline per layer plus the casts
and the update (`step_seconds`). `speed_report.py` turns them into the
table, the bound and the advice."""

import keras

from keras_mp._src import keras_internals
from keras_mp._src.optimizer import low_precision_state
from keras_mp._src.precision import step_cost
from keras_mp._src.precision.levels import HALF_DTYPES
from keras_mp._src.precision.policies import decide_all
from keras_mp._src.precision.step_cost import nbytes
from keras_mp._src.precision.step_cost import numel


def slots_of(model):
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.SGD):
        return 1 if inner.momentum else 0
    return 2  # Adam, AdamW and most others


def moments_of(model):
    """The model's optimizer's `moment_dtypes` (None: float32 slots)."""
    return getattr(getattr(model, "optimizer", None), "moment_dtypes", None)


def _float8_state(layer, policy):
    """The shapes of the scales and amax histories that Keras's float8
    policy adds to a layer not quantized yet (float32 each)."""
    if not step_cost.is_float8(policy) or step_cost.is_float8(layer.dtype_policy):
        return []
    return [()] * 3 + [(policy.amax_history_length,)] * 3


def memory(model, amp, slots, replicas, shard, accounts, moment_dtypes=None):
    """Bytes of weights, optimizer state and kept activations at `amp`
    (`moment_dtypes`: Adam's moments in low precision, their scales aside)."""
    per_weight = low_precision_state.bytes_per_weight(moment_dtypes, slots)
    weights = optimizer = 0
    for layer, (policy_name, _) in decide_all(model, amp):
        policy = keras.dtype_policies.get(policy_name) if policy_name else layer.dtype_policy
        # Keras's optimizers keep no slots for them (their gradient is
        # their new value).
        weights += sum(numel(shape) * 4 for shape in _float8_state(layer, policy))
        for variable in keras_internals.own_variables(layer):
            dtype = step_cost.variable_dtype(layer, variable, policy)
            size = numel(variable.shape)
            weights += size * nbytes(dtype)
            if not variable.trainable or getattr(variable, "overwrite_with_gradient", False):
                continue
            state = per_weight * size  # float32 slots (master copies' at O3) unless low
            if dtype in HALF_DTYPES:
                state += size * 4  # the float32 master copy
            optimizer += state / replicas if shard else state
    return {
        "weights": weights,
        "optimizer": int(optimizer),
        "activations": sum(a.kept for a in accounts.values()),
    }


def step_seconds(accounts, bytes_, peaks, tf32):
    layers = sum(step_cost.layer_seconds(a, peaks, tf32) for a in accounts.values())
    casts = sum(a.cast_bytes for a in accounts.values()) / peaks.bandwidth
    # The update reads and writes weights and state, and reads the gradients.
    update = (3 * bytes_["weights"] + 2 * bytes_["optimizer"]) / peaks.bandwidth
    return layers + casts + update
