"""A skipped step keeps all model state, not only the trainable weights.

A batch with a NaN in it also writes NaN into BatchNorm's moving mean and
variance during the forward pass, before any gradient exists. Under
`compile(amp_level=...)` the train step is wrapped: the non-trainable
variables are read before the step and put back when the LossScaleOptimizer
skipped it. The decision is read from the optimizer's own `skipped_steps`
(did it move?), on the device: a select per variable, no host sync.
"""

import keras
from keras import ops

_ORIGINAL = "_keras_mp_original_train_step"


def guard_train_step(model):
    """Wraps `model.train_step` (idempotent); a no-op without a keras_mp LSO."""
    from keras_mp._src.loss_scale_optimizer import LossScaleOptimizer

    original = model.__dict__.get(_ORIGINAL) or model.train_step
    optimizer = model.optimizer
    if not isinstance(optimizer, LossScaleOptimizer) or not optimizer._config.checks_finite:
        # Nothing is ever skipped: plain Keras step.
        model.__dict__.pop("train_step", None)
        return
    if keras.backend.backend() == "jax":
        train_step = _jax_train_step(original, optimizer)
    else:
        train_step = _stateful_train_step(original, model, optimizer)
    object.__setattr__(model, _ORIGINAL, original)
    object.__setattr__(model, "train_step", train_step)
    # Keras caches the compiled step; make it trace the guarded one.
    model.train_function = None


def _stateful_train_step(original, model, optimizer):
    def train_step(data):
        variables = model.non_trainable_variables
        # Copies: on PyTorch `.value` is the parameter itself, updated in place.
        before = [ops.copy(v.value) for v in variables]
        skipped_before = ops.copy(optimizer.skipped_steps.value)
        logs = original(data)
        skipped = ops.not_equal(optimizer.skipped_steps.value, skipped_before)
        for variable, old in zip(variables, before):
            variable.assign(ops.where(skipped, old, variable.value))
        return logs

    return train_step


def _jax_train_step(original, optimizer):
    def train_step(state, data):
        position = [id(v) for v in optimizer.variables].index(id(optimizer.skipped_steps))
        old_non_trainable = state[1]
        logs, new_state = original(state, data)
        trainable, non_trainable, optimizer_values, metrics = new_state
        skipped = ops.not_equal(optimizer_values[position], state[2][position])
        non_trainable = [
            ops.where(skipped, old, new) for old, new in zip(old_non_trainable, non_trainable)
        ]
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    return train_step
