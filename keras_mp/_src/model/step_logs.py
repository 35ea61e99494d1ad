"""What a keras_mp train step puts in `fit`'s and `train_on_batch`'s logs.

The optimizer's `loss_scale` and `skipped_steps`: each value in a step's
logs is brought to the host after every step, so the step returns them only
where something reads each batch's logs (the live progress bar, `verbose=1`,
or a callback with batch hooks, such as `OverflowGuard`); otherwise `fit`
adds them to each epoch's logs, read from the optimizer's variables once an
epoch. Outside `fit` (`train_on_batch`) the step returns them. The step
itself is `train_step.py`'s.
"""

import functools
import inspect

import keras

from keras_mp._src.model.callbacks import EpochTelemetry
from keras_mp._src.model.callbacks import ProgbarLogger
from keras_mp._src.model.callbacks import SkippedStepsWarning
from keras_mp._src.model.callbacks import telemetry_keys

BATCH_TELEMETRY = "_keras_mp_batch_telemetry"


def batch_telemetry(model):
    """Whether the traced step puts the telemetry in its logs."""
    return model.__dict__.get(BATCH_TELEMETRY, True)


def fit_with_telemetry(fit, set_batch_telemetry):
    """`fit`, with the telemetry in its logs at no cost per step.

    - The step returns `loss_scale` and `skipped_steps` only if a callback
      reads each batch's logs (see the module docstring); else an
      `EpochTelemetry` callback, first in the list, adds them to each
      epoch's logs.
    - Keras's bar prints every log value as a float (`0.0000e+00`); unless
      the caller passes a `ProgbarLogger` of their own, keras_mp's (the same
      bar, counts as integers) takes its place.
    - A run whose steps are mostly skipped says so while it runs
      (`SkippedStepsWarning`, from the values the logs carry).

    Nothing else about `fit` changes.
    """
    signature = inspect.signature(fit)

    @functools.wraps(fit)
    def fit_with_telemetry(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fit(*args, **kwargs)  # Keras's own error
        callbacks = bound.arguments.get("callbacks")
        verbose = bound.arguments.get("verbose", "auto")
        if isinstance(callbacks, keras.callbacks.CallbackList):
            set_batch_telemetry(True)  # the caller's own list, as it is
            return fit(*bound.args, **bound.kwargs)
        callbacks = list(keras.tree.flatten(callbacks)) if callbacks else []
        own_bar = any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks)
        if verbose != 0 and not own_bar:
            callbacks.append(ProgbarLogger())
        live_bar = verbose in (1, "auto")  # Keras's "auto" is 1 in `fit`
        set_batch_telemetry(live_bar or any(reads_batch_logs(c) for c in callbacks))
        bound.arguments["callbacks"] = [EpochTelemetry(), SkippedStepsWarning()] + callbacks
        return fit(*bound.args, **bound.kwargs)

    return fit_with_telemetry


def train_on_batch_with_telemetry(train_on_batch, set_batch_telemetry):
    """`train_on_batch`, whose logs always carry the telemetry (its caller
    reads them), also after a `fit` that traced the step without it."""

    @functools.wraps(train_on_batch)
    def train_on_batch_with_telemetry(*args, **kwargs):
        set_batch_telemetry(True)
        return train_on_batch(*args, **kwargs)

    return train_on_batch_with_telemetry


def reads_batch_logs(callback):
    """Whether a callback looks at each training batch's logs."""
    if isinstance(callback, keras.callbacks.ProgbarLogger):
        return False  # it follows `fit`'s `verbose`
    return not all(
        getattr(getattr(callback, hook), "_is_default", False)
        for hook in ("on_train_batch_end", "on_batch_end")
    )


def with_telemetry(logs, values):
    """`logs` with `values` (`{label: (loss_scale, skipped_steps)}`) added."""
    if not isinstance(logs, dict):
        return logs  # a custom train_step's own return value: left as it is
    logs = dict(logs)
    for label, pair in values.items():
        logs.update(zip(telemetry_keys(label), pair))
    return logs
