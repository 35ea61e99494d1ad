"""`OverflowGuard`: stop a run whose steps keep overflowing, and say why."""

import math
import numbers
import warnings

import keras
import numpy as np

from keras_mp._src import keras_internals
from keras_mp._src.model import skip_advice
from keras_mp._src.model.wrapping import loss_scale_optimizers

TELEMETRY_KEYS = ("loss_scale", "skipped_steps")


def telemetry_keys(label):
    """The log keys of an optimizer's scale and skip count: `loss_scale` and
    `skipped_steps` for the model's `optimizer`, `d_optimizer_loss_scale`
    and `d_optimizer_skipped_steps` for a `d_optimizer` of its own."""
    if label == "optimizer":
        return TELEMETRY_KEYS
    return tuple(f"{label}_{key}" for key in TELEMETRY_KEYS)


def _value(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).item()


class OverflowGuard(keras.callbacks.Callback):
    """Stops training when steps keep being skipped for non-finite gradients.

    A LossScaleOptimizer skips a step whose gradients overflow and backs the
    scale off; a few such steps are routine. A long run of them means the
    model itself produces inf/NaN (diverged weights, bad data, a layer that
    overflows float16) and training makes no progress while looking busy.
    The guard stops `fit` with a message saying how many steps were skipped
    in a row, the loss scale, and what fits the cause (`skip_advice.py`:
    a scale pinned at `min_scale` needs a lower floor, not a lower learning
    rate), when

    - `patience` steps in a row were skipped, or
    - a step was skipped with the dynamic scale already at its floor (it
      cannot back off any further): `min_scale`, or 2**-126 without one.

    It reads the optimizer's `skipped_steps` and `loss_scale` from the step's
    logs one step late: the step before the current one has finished, so
    reading it never holds up the device. Training therefore stops one step
    after the step that triggered it (nothing is applied by skipped steps).
    A model that trains with several optimizers (a GAN's `d_optimizer` and
    `g_optimizer`) has each watched on its own; the message names the one
    that stopped it.

    Args:
        patience: int >= 1, the number of consecutive skipped steps to allow.
        stop_at_min_scale: bool, whether a skipped step at the scale's floor
            (`min_scale`, or 2**-126 without one) stops training at once.
        verbose: 0 or 1; 1 prints the message when it stops training.

    Attributes:
        stopped_step: the step (counted from 0 in this `fit`) that triggered
            the stop, or None.
        message: the message, or None.
    """

    def __init__(self, patience=10, stop_at_min_scale=True, verbose=1):
        super().__init__()
        if not isinstance(patience, numbers.Integral) or isinstance(patience, bool) or patience < 1:
            raise ValueError(
                f"`patience` must be an integer >= 1 (consecutive skipped steps). "
                f"Received: patience={patience!r}"
            )
        if not isinstance(stop_at_min_scale, bool):
            raise TypeError(
                f"`stop_at_min_scale` must be True or False. "
                f"Received: stop_at_min_scale={stop_at_min_scale!r}"
            )
        if verbose not in (0, 1):
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        self.patience = int(patience)
        self.stop_at_min_scale = stop_at_min_scale
        self.verbose = verbose
        self.stopped_step = None
        self.message = None

    def on_train_begin(self, logs=None):
        optimizers = loss_scale_optimizers(self.model)
        if not optimizers:
            raise TypeError(
                "OverflowGuard watches a keras_mp.LossScaleOptimizer: compile "
                "the model with one (or with `amp_level=`). Received: "
                f"optimizer={getattr(self.model, 'optimizer', None)!r}"
            )
        checked = [(label, o) for label, o in optimizers if o._config.checks_finite]
        if not checked:
            raise ValueError(
                "OverflowGuard needs an optimizer that skips overflowing steps; "
                "this one applies every step unchecked (dynamic=False, "
                "skip_on_overflow=False). Received: "
                f"skip_on_overflow={optimizers[0][1].skip_on_overflow!r}"
            )
        # Every optimizer the model trains with (a GAN's two), each watched
        # on its own: its streak of skipped steps, its scale.
        self._watches = [_Watch(label, o) for label, o in checked]
        self._optimizer = self._watches[0].optimizer
        self._step = 0
        self._pending = []
        self.stopped_step = None
        self.message = None

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        values = []
        for watch in self._watches:
            skipped_key, scale_key = telemetry_keys(watch.label)[::-1]
            if skipped_key in logs and scale_key in logs:
                values.append((logs[skipped_key], logs[scale_key]))
            else:  # A step without keras_mp's logs for it: the variables.
                values.append(
                    (
                        keras.ops.copy(watch.optimizer.skipped_steps.value),
                        keras.ops.copy(watch.optimizer.loss_scale.value),
                    )
                )
        self._pending.append((self._step, values))
        self._step += 1
        while len(self._pending) > 1:
            self._check(*self._pending.pop(0))

    def on_epoch_end(self, epoch, logs=None):
        self._drain()

    def on_train_end(self, logs=None):
        self._drain()

    def _drain(self):
        while getattr(self, "_pending", None):
            self._check(*self._pending.pop(0))

    def _check(self, step, values):
        for watch, (skipped_steps, loss_scale) in zip(self._watches, values):
            if self.stopped_step is not None:
                return
            what = watch.update(
                int(_value(skipped_steps)),
                float(_value(loss_scale)),
                self.patience,
                self.stop_at_min_scale,
            )
            if what is None:
                continue
            whose = "" if watch.label == "optimizer" else f"`{watch.label}`: "
            cause, advice = skip_advice.diagnosis(watch.optimizer, watch.last_scale)
            self.message = (
                f"OverflowGuard stopped training at step {step}: {whose}{what}; "
                f"{watch.last_skipped} steps skipped in all. Why: {cause}. {advice}"
            )
            self.stopped_step = step
            self.model.stop_training = True
            if self.verbose:
                keras_internals.print_msg(self.message)


class _Watch:
    """One optimizer's skipped steps in a row, and its scale, for OverflowGuard."""

    def __init__(self, label, optimizer):
        self.label = label
        self.optimizer = optimizer
        self.last_skipped = _value(optimizer.skipped_steps)
        self.last_scale = float(_value(optimizer.loss_scale))
        self.streak = 0

    def update(self, skipped_steps, loss_scale, patience, stop_at_min_scale):
        """Takes a step's values; returns why to stop, or None."""
        new_skips = skipped_steps - self.last_skipped
        scale_before, self.last_scale = self.last_scale, loss_scale
        self.last_skipped = skipped_steps
        self.streak = self.streak + new_skips if new_skips > 0 else 0
        optimizer = self.optimizer
        pinned = (
            stop_at_min_scale and new_skips > 0 and skip_advice.at_floor(optimizer, scale_before)
        )
        if self.streak < patience and not pinned:
            return None
        if pinned:
            floor = (
                "pinned at its lowest, 2**-126"
                if optimizer.min_scale is None
                else f"pinned at min_scale={optimizer.min_scale:g}"
            )
            return (
                f"the loss scale is {floor} and steps still overflow "
                f"({self.streak} skipped in a row)"
            )
        if not optimizer.dynamic:
            kind = " (fixed)"
        elif optimizer.min_scale is None:
            kind = ""
        else:
            kind = f" (min_scale={optimizer.min_scale:g})"
        return (
            f"{self.streak} steps in a row were skipped because their "
            f"gradients were not finite (patience={patience}); the "
            f"loss scale is {skip_advice.scale_text(loss_scale)}{kind}"
        )


class _Whole(float):
    """A log value shown without Keras's four decimals when it is whole.

    Keras's progress bar divides a stateful value by 1 and formats it with
    `.4f` (or `.4e` below 1e-3, which gave `skipped_steps: 0.0000e+00`);
    both keep this type, which prints `3` and `32768` (and `0.5` as `0.5`).
    """

    def __truediv__(self, other):
        return _Whole(float(self) / other)

    def __format__(self, spec):
        value = float(self)
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else f"{value:g}"


class _Progbar(keras.utils.Progbar):
    def update(self, current, values=None, finalize=None):
        values = [
            (k, _Whole(v) if k.endswith(WHOLE_KEYS) and isinstance(v, (int, float)) else v)
            for k, v in (values or [])
        ]
        if self.stateful_metrics is not None:
            # A bar that averages what it is not told is stateful (as Keras
            # 3.10's does) shows the scale and the count as they are now.
            self.stateful_metrics.update(k for k, _ in values if k.endswith(WHOLE_KEYS))
        super().update(current, values, finalize=finalize)


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, with keras_mp's telemetry shown as whole numbers.

    `fit` of a model compiled with keras_mp's LossScaleOptimizer uses it in
    place of Keras's (unless a `ProgbarLogger` is passed in `callbacks`):
    `loss_scale: 32768 - skipped_steps: 3`, not `32768.0000` and `3.0000`.
    """

    def _maybe_init_progbar(self):
        # Keras makes its bar (with the arguments of its release); it then
        # prints the counts as whole numbers.
        fresh = self.progbar is None
        super()._maybe_init_progbar()
        if fresh and type(self.progbar) is keras.utils.Progbar:
            self.progbar.__class__ = _Progbar


WHOLE_KEYS = ("loss_scale", "skipped_steps")


class EpochTelemetry(keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to each epoch's logs.

    `fit` puts it first in the callbacks (so that `History`, the progress bar
    and the caller's callbacks see the values) when no callback reads each
    batch's logs, and the step does not return them: the optimizer's
    variables are read once an epoch (on JAX, after Keras's own state sync).
    """

    async_safe = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        optimizers = loss_scale_optimizers(self.model)
        applied = [(label, o) for label, o in optimizers if o._applies]
        for label, optimizer in applied or optimizers:
            scale_key, skipped_key = telemetry_keys(label)
            if scale_key not in logs:
                logs[scale_key] = float(_value(optimizer.loss_scale))
                logs[skipped_key] = float(_value(optimizer.skipped_steps))


class SkippedStepsWarning(keras.callbacks.Callback):
    """Warns, while `fit` runs, when most of its steps are being skipped.

    `fit` adds it after `EpochTelemetry`. It reads no value of its own
    during the run: the optimizer's `skipped_steps` and `loss_scale` where
    the logs already carry them (each epoch's, and each step's where the
    progress bar or a batch callback reads them), the number of steps from
    the batch index. A window of steps starts at the first of these
    values and restarts at each epoch end where it was not mostly
    skipped; it warns, once a `fit` for each optimizer,
    when more than half the window's steps were skipped and at least
    `UNEXPLAINED` of those skips are more than its dynamic scale's fall
    explains (each skip backs it off once: a run finding its scale at the
    start skips only those). The message says why, from where the scale
    stands (`skip_advice.py`).
    """

    async_safe = True
    UNEXPLAINED = 8

    def on_train_begin(self, logs=None):
        self._windows = [
            _Window(label, optimizer)
            for label, optimizer in loss_scale_optimizers(self.model)
            if optimizer.config.checks_finite
        ]
        self._done = 0  # the steps of the epochs that ended
        self._epoch_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps = max(self._epoch_steps, batch + 1)
        self._check(logs, epoch_end=False)

    def on_epoch_end(self, epoch, logs=None):
        self._done += self._epoch_steps
        self._epoch_steps = 0
        self._check(logs, epoch_end=True)

    def _check(self, logs, epoch_end):
        steps = self._done + self._epoch_steps
        for window in getattr(self, "_windows", ()):
            scale_key, skipped_key = telemetry_keys(window.label)
            if logs and scale_key in logs and skipped_key in logs:
                window.check(steps, int(logs[skipped_key]), float(logs[scale_key]), epoch_end)


class _Window:
    """One optimizer's steps since its window began, for SkippedStepsWarning."""

    def __init__(self, label, optimizer):
        self.label = label
        self.optimizer = optimizer
        self.warned = False
        # Where the window starts: the first values the logs carry (reading
        # the variables at the start of `fit` would be a read of its own).
        self.steps = None

    def _restart(self, steps, skipped, scale):
        self.steps, self.skipped, self.scale = steps, skipped, scale

    def check(self, steps, skipped, scale, epoch_end):
        if self.steps is None:
            self._restart(steps, skipped, scale)
            return
        taken, skips = steps - self.steps, skipped - self.skipped
        mostly = 2 * skips > taken
        if (
            mostly
            and not self.warned
            and skips - self._fall(scale) >= SkippedStepsWarning.UNEXPLAINED
        ):
            self.warned = True
            whose = "" if self.label == "optimizer" else f" (`{self.label}`)"
            cause, advice = skip_advice.diagnosis(self.optimizer, scale)
            warnings.warn(
                f"keras_mp: {skips} of the last {taken} training steps were "
                f"skipped{whose}, their gradients not finite: the model hardly "
                f"trains. Why: {cause}. {advice}",
                stacklevel=2,
            )
        if epoch_end and not mostly:
            self._restart(steps, skipped, scale)

    def _fall(self, scale):
        """How many back-offs took the dynamic scale from the window's start
        to `scale`, counted down to `_LOWEST_NEEDED` only: a float16
        gradient that overflows below it is over 1e12, which no scale
        explains (an infinite loss at every scale, a diverged model)."""
        optimizer = self.optimizer
        scale = max(scale, _LOWEST_NEEDED)
        if not optimizer.dynamic or scale >= self.scale:
            return 0
        return round(math.log(self.scale / scale) / -math.log(optimizer.backoff_factor))


# The lowest scale a run's gradients are taken to need (float16's largest
# value, 65504, over it is 1.1e12).
_LOWEST_NEEDED = 2.0**-24
