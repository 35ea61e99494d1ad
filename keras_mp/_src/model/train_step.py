"""The train step of a model compiled with keras_mp's LossScaleOptimizer:
telemetry in the logs, and restoring the model's state on a skipped step.

Two additions to Keras's own step, both computed on the device (no value is
brought to the host):

- Telemetry: `fit`'s logs carry the optimizer's `loss_scale` and
  `skipped_steps`, so they appear in the progress bar, in `History` and in
  `keras.callbacks.TensorBoard`; when the step returns them is
  `step_logs.py`'s.
- The BatchNorm guard (under `compile(amp_level=...)`): a batch with a NaN in
  it also writes NaN into BatchNorm's moving mean and variance during the
  forward pass, before any gradient exists. The non-trainable variables are
  read before the step and put back when the LossScaleOptimizer skipped it,
  decided from the optimizer's own `skipped_steps` (did it move?): a select
  per variable. The metrics keep a skipped batch unless it made them
  non-finite: a NaN batch's loss does not turn the epoch's mean into NaN,
  and a batch skipped for overflowing gradients (its loss finite) counts,
  as under Keras's own LossScaleOptimizer; an epoch whose steps all
  overflowed reports its loss, not 0.
"""

import contextlib
import functools

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.model import assigned_half
from keras_mp._src.model import lm_step
from keras_mp._src.model import step_logs
from keras_mp._src.model.wrapping import loss_scale_optimizers
from keras_mp._src.optimizer.master_weights import float32_grads_of
from keras_mp._src.precision import fallback

_ORIGINAL = "_keras_mp_original_train_step"
_GUARD = "_keras_mp_guard"


def _set_batch_telemetry(model, on):
    if step_logs.batch_telemetry(model) != on:
        object.__setattr__(model, step_logs.BATCH_TELEMETRY, on)
        # A new step function, traced again with or without them (JAX
        # caches a trace per function object).
        guard_train_step(model, guard=model.__dict__[_GUARD])


def guard_train_step(model, guard=True):
    """Wraps `model.train_step` (idempotent); a no-op without a keras_mp LSO.

    Every keras_mp LossScaleOptimizer the model holds (`model.optimizer`, or
    attributes of its own such as a GAN's `d_optimizer`) is watched: each
    one's scale and skip count go to the logs (`telemetry_keys`), and each
    learns at every step whether the loss reached its `scale_loss`.

    Args:
        model: a compiled `keras.Model`.
        guard: whether a skipped step also restores the non-trainable
            variables (under `amp_level`); telemetry is always added.
    """
    original = model.__dict__.get(_ORIGINAL) or model.train_step
    optimizers = loss_scale_optimizers(model)
    if not optimizers:
        # Not keras_mp's optimizer: the plain Keras step.
        if _ORIGINAL in model.__dict__:
            model.__dict__.pop("train_step", None)
            model.__dict__.pop(_ORIGINAL, None)
            model.__dict__.pop("fit", None)
            model.__dict__.pop("train_on_batch", None)
            model.train_function = None
        if lm_step.SETTING in model.__dict__:
            # A level without a loss scale (O0): only the loss's chunks.
            object.__setattr__(model, _ORIGINAL, original)
            object.__setattr__(model, "train_step", lm_step.chunked_only(original, model))
            model.train_function = None
        return
    guard = guard and any(o.config.checks_finite for _, o in optimizers)
    assigned_half.watch(model)
    if backends.current.STATELESS:
        train_step = _stateless_train_step(original, model, optimizers, guard)
    else:
        train_step = _stateful_train_step(original, model, optimizers, guard)
    object.__setattr__(model, _ORIGINAL, original)
    object.__setattr__(model, _GUARD, guard)
    object.__setattr__(model, "train_step", train_step)
    if "fit" not in model.__dict__:
        retrace = functools.partial(_set_batch_telemetry, model)
        object.__setattr__(model, "fit", step_logs.fit_with_telemetry(model.fit, retrace))
        object.__setattr__(
            model,
            "train_on_batch",
            step_logs.train_on_batch_with_telemetry(model.train_on_batch, retrace),
        )
    # Keras caches the compiled step; make it trace the wrapped one.
    model.train_function = None


class _StepFlags:
    """Each optimizer learns, for the step being traced (or run), whether
    the loss reached its `scale_loss` (`LossScaleOptimizer._scaled_this_step`)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        self._applies = [o._applies for _, o in optimizers]

    def __enter__(self):
        for _, optimizer in self.optimizers:
            optimizer._scaled_this_step = False
        return self

    def __exit__(self, *exc):
        for _, optimizer in self.optimizers:
            optimizer._scaled_this_step = None

    def applied(self):
        """The `(label, optimizer)`s the step applied (a GAN's `compile`
        leaves `optimizer` unused), or all of them if it applied none."""
        used = [
            pair
            for pair, before in zip(self.optimizers, self._applies)
            if pair[1]._applies != before
        ]
        return used or self.optimizers


def _bad_metrics(skipped, metrics):
    """Whether to put the metrics back: the step was skipped and the batch
    made one of them non-finite (a NaN batch; an overflow's loss is finite)."""
    finite = [ops.all(ops.isfinite(m)) for m in metrics if keras.backend.is_float_dtype(m.dtype)]
    if not finite:
        return skipped
    return ops.logical_and(skipped, ops.logical_not(ops.all(ops.stack(finite))))


def _stateful_train_step(original, model, optimizers, guard):
    # Decided once: whether the step is Keras's own (`_taking_float32_grads`).
    keras_own = backends.current.Float32Grads is not None
    keras_own = keras_own and keras_internals.is_keras_train_step(original)
    # PyTorch's eager step reads its one flag on the host (as GradScaler):
    # whether it skipped is a Python fact there, so a step that applied
    # (nearly all) restores nothing, with no op at all. Under torch.compile,
    # and on TensorFlow, the optimizer's `skipped_steps` decides by selects.
    on_host = backends.current.EAGER_STEP and not model.jit_compile

    def train_step(data):
        if guard:
            # The model's state, and the metrics' (see `_bad_metrics`).
            # Copies: on PyTorch `.value` is the parameter itself, updated in place.
            state = [(v, ops.copy(v.value)) for v in model.non_trainable_variables]
            metrics = [(v, ops.copy(v.value)) for v in model.metrics_variables]
            if on_host:
                skipped_before = [o._host_skips for _, o in optimizers]
            else:
                skipped_before = [ops.copy(o.skipped_steps.value) for _, o in optimizers]
        with _StepFlags(optimizers) as flags, assigned_half.Noting(model, optimizers):
            try:
                with (
                    _taking_float32_grads(model, optimizers, keras_own),
                    lm_step.chunking(model, data),
                ):
                    logs = original(data)
            except Exception as error:
                if not backends.current.EAGER_STEP or not fallback.may_come_from_half(error):
                    raise
                # PyTorch: a layer without a half gradient kernel here.
                _keep_failing_layers_in_float32(model, error)
                if guard:  # the failed try updated the metrics already
                    for variable, old in state + metrics:
                        variable.assign(old)
                with (
                    _taking_float32_grads(model, optimizers, keras_own),
                    lm_step.chunking(model, data),
                ):
                    logs = original(data)
        if guard and on_host:
            if any(o._host_skips != before for (_, o), before in zip(optimizers, skipped_before)):
                bad_metrics = _bad_metrics(True, [v.value for v, _ in metrics])
                for variable, old in state:
                    variable.assign(old)
                for variable, old in metrics:
                    variable.assign(ops.where(bad_metrics, old, variable.value))
        elif guard:
            # Any optimizer's skip: a NaN batch skips them all.
            moved = [
                ops.not_equal(o.skipped_steps.value, before)
                for (_, o), before in zip(optimizers, skipped_before)
            ]
            skipped = moved[0] if len(moved) == 1 else ops.any(ops.stack(moved))
            bad_metrics = _bad_metrics(skipped, [v.value for v, _ in metrics])
            for restore, pairs in ((skipped, state), (bad_metrics, metrics)):
                for variable, old in pairs:
                    variable.assign(ops.where(restore, old, variable.value))
        if not step_logs.batch_telemetry(model):
            return logs
        return step_logs.with_telemetry(
            logs,
            {
                label: (
                    backends.current.log_value(o.loss_scale),
                    backends.current.log_value(o.skipped_steps),
                )
                for label, o in flags.applied()
            },
        )

    return train_step


def _taking_float32_grads(model, optimizers, keras_own):
    """PyTorch at O3: inside Keras's own train step (`keras_own`), each
    optimizer with master weights takes the half gradients in float32 as the
    backward pass makes them (`backends.torch.Float32Grads`), so that the
    step holds float32 gradients, as under Keras's policy, not half ones
    beside them. Not in a model's own `train_step` (it may read `.grad`),
    nor under `jit_compile` (torch.compile traces the step)."""
    if not keras_own or model.jit_compile:
        return contextlib.nullcontext()
    takers = [t for t in (float32_grads_of(o) for _, o in optimizers) if t is not None]
    if not takers:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for taker in takers:
        stack.enter_context(taker.collecting())
    return stack


def _keep_failing_layers_in_float32(model, error):
    """After a failed eager step: the layers that fail alone in half compute
    in float32 (`fallback.find_layers_failing_in_half`); re-raises when none
    does, saying so."""
    failing = fallback.find_layers_failing_in_half(model)
    if not failing:
        fallback.note_no_layer_fails_alone(error)
        raise error
    for layer, layer_error in failing:
        half = keras.backend.standardize_dtype(layer.compute_dtype)
        fallback.keep_in_float32(
            layer,
            f"fails in {half} on this device ({fallback.first_line(layer_error)}): float32",
        )


class _OnlyTheModelsOptimizer:
    """JAX: Keras's compiled `fit` step carries `model.optimizer`'s values
    only (the other variables hold no value while it is traced), so any
    other optimizer (a GAN's `d_optimizer`, a layer's own) that the step
    applies is refused by name while the step is traced, with the loop that
    does it; a step that fails before reaching it gets the same note."""

    def __init__(self, optimizers):
        self.others = [label for label, _ in optimizers if label != "optimizer"]
        self.optimizers = [o for label, o in optimizers if label != "optimizer"]

    def _message(self, labels):
        names = ", ".join(f"`{label}`" for label in labels)
        return (
            f"keras_mp: on JAX, `fit`'s compiled train step carries only "
            f"`model.optimizer`'s state (Keras's JAX trainer): the variables of "
            f"{names} and of the layers they train hold no value there and "
            f"cannot change. Train such a model with a `jax.jit` loop of your "
            f"own that passes each optimizer's variables through its "
            f"`stateless_apply` (keras_mp's `examples/gan.py` does it for two "
            f"optimizers), or with the TensorFlow or PyTorch backend, whose "
            f"`fit` takes it as written."
        )

    def __enter__(self):
        for label, optimizer in zip(self.others, self.optimizers):

            def refuse(*args, label=label, **kwargs):
                raise ValueError(self._message([label]))

            object.__setattr__(optimizer, "apply", refuse)

    def __exit__(self, kind, error, traceback):
        for optimizer in self.optimizers:
            optimizer.__dict__.pop("apply", None)
        if error is not None and self.others and not str(error).startswith("keras_mp: on JAX"):
            raise ValueError(
                f"The train step failed ({type(error).__name__}: {error}). "
                + self._message(self.others)
            ) from error


def _stateless_train_step(original, model, optimizers, guard):
    # JAX's step carries `model.optimizer`'s values only: the others'
    # variables cannot change inside it (Keras's JAX trainer).
    optimizer = dict(optimizers).get("optimizer")

    def train_step(state, data):
        old_non_trainable = state[1]
        with (
            _StepFlags(optimizers),
            _OnlyTheModelsOptimizer(optimizers),
            lm_step.chunking(model, data),
        ):
            logs, new_state = original(state, data)
        assigned_half.check_returned(model, old_non_trainable, new_state[1])
        if optimizer is None:
            return logs, new_state
        ids = [id(v) for v in optimizer.variables]
        scale_at = ids.index(id(optimizer.loss_scale))
        skipped_at = ids.index(id(optimizer.skipped_steps))
        trainable, non_trainable, optimizer_values, metrics = new_state
        if guard:
            skipped = ops.not_equal(optimizer_values[skipped_at], state[2][skipped_at])
            non_trainable = [
                ops.where(skipped, old, new) for old, new in zip(old_non_trainable, non_trainable)
            ]
            bad_metrics = _bad_metrics(skipped, metrics)
            metrics = [ops.where(bad_metrics, old, new) for old, new in zip(state[3], metrics)]
        if step_logs.batch_telemetry(model):
            values = {"optimizer": (optimizer_values[scale_at], optimizer_values[skipped_at])}
            logs = step_logs.with_telemetry(logs, values)
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    return train_step
