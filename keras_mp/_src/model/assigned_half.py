"""Half weights a train step assigns to but no optimizer trains: an EMA copy.

keras-io's DDIM keeps an exponential moving average of its network in a
second network, updated in its `train_step` by
`ema_weight.assign(ema * ema_weight + (1 - ema) * weight)`. At O3 that
network's weights are half like the rest, and no optimizer (so no float32
master copy) stands behind them: in bfloat16 an increment below 1/256 of a
weight rounds away, and with `ema = 0.999` the copy covers a quarter of
its distance or less. Nothing fails; the EMA is silently wrong.

keras_mp cannot tell an EMA copy from a frozen teacher before the step
runs (both are networks no optimizer trains; a teacher in half is what O3
is for), so it watches: the half weights of the models a subclassed model
holds have their `assign` noted while a `fit` step is traced (or run), and
on JAX the values a stateless step returns for them are told from those it
was given (`check_returned`); a weight assigned there that no optimizer
trains is named, once, with the fix: keep that network in float32
(`deny=[model.ema_network]`: it is not trained, so it costs no optimizer
memory) and cast what is assigned from the half network to its dtype.
"""

import threading
import warnings

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.levels import HALF_DTYPES

_WATCHED = "_keras_mp_assign_watched"
_CHECKED = "_keras_mp_assigns_checked"
_STEP = threading.local()  # `noted`: ids of the variables assigned in this step


def watch(model):
    """Notes `assign` on the half weights of the models `model` holds."""
    if not layer_tree.is_subclassed(model):
        return
    for held in keras_internals.children(model):
        if not layer_tree.is_container(held):
            continue
        for variable in _weights(held):
            if keras.backend.standardize_dtype(variable.dtype) not in HALF_DTYPES:
                continue
            if getattr(variable, _WATCHED, False):
                continue
            object.__setattr__(variable, "assign", _noted(variable, variable.assign))
            object.__setattr__(variable, _WATCHED, True)


def _weights(held):
    """A network's weights, trainable or frozen (not BatchNorm's statistics,
    which its forward pass assigns)."""
    return [
        v
        for layer in layer_tree.layers_in_order(held)
        for v in keras_internals.own_trainable_variables(layer)
    ]


def _noted(variable, assign):
    def assign_noted(value):
        noted = getattr(_STEP, "noted", None)
        if noted is not None:
            noted.add(id(variable))
        return assign(value)

    return assign_noted


class Noting:
    """Around the first `fit` step traced (or run): notes the assignments,
    then names a network assigned to in half that no optimizer trains."""

    def __init__(self, model, optimizers):
        self.model = model
        self.optimizers = optimizers
        self.on = not model.__dict__.get(_CHECKED, False)

    def __enter__(self):
        if self.on:
            _STEP.noted = set()
            self.trained = set()
            for _, optimizer in self.optimizers:  # what each `apply` is given
                object.__setattr__(optimizer, "apply", self._noting_apply(optimizer))
        return self

    def _noting_apply(self, optimizer):
        apply = optimizer.apply

        def apply_noting(grads, trainable_variables=None):
            if trainable_variables is None and optimizer.built:
                trainable_variables = keras_internals.built_variables(optimizer)
            trainable_variables = list(trainable_variables or [])
            self.trained.update(id(v) for v in trainable_variables)
            return apply(grads, trainable_variables or None)

        return apply_noting

    def __exit__(self, kind, error, traceback):
        if not self.on:
            return False
        noted, _STEP.noted = _STEP.noted, None
        for _, optimizer in self.optimizers:
            optimizer.__dict__.pop("apply", None)
        if kind is not None:
            return False
        object.__setattr__(self.model, _CHECKED, True)
        trained = self.trained
        for name, held in _held_models(self.model):
            assigned = [v for v in _weights(held) if id(v) in noted and id(v) not in trained]
            if assigned:
                _warn(name, held, assigned[0])
        return False


def check_returned(model, old_values, new_values):
    """JAX, at the first trace of a stateless step: a step written for JAX
    (keras-io DDIM's JAX form) does not `assign` its EMA, it returns the EMA
    network's new values with the non-trainable variables. A value returned
    that is not the one the step was given was computed by the step: named
    as an assignment is (`Noting`). Read off the traced values' identity:
    nothing is added to the program."""
    if model.__dict__.get(_CHECKED, False):
        return
    object.__setattr__(model, _CHECKED, True)
    computed = {
        id(variable)
        for variable, old, new in zip(model.non_trainable_variables, old_values, new_values)
        if new is not old
    }
    for name, held in _held_models(model):
        assigned = [
            v
            for v in _weights(held)
            if id(v) in computed and keras.backend.standardize_dtype(v.dtype) in HALF_DTYPES
        ]
        if assigned:
            _warn(name, held, assigned[0], stacklevel=4)


def _held_models(model):
    for name, value in keras_internals.attributes(model).items():
        if not name.startswith("_") and layer_tree.is_container(value):
            yield name, value


def _warn(name, held, variable, stacklevel=2):
    half = keras.backend.standardize_dtype(variable.dtype)
    spacing = "1/256" if half == "bfloat16" else "1/2048"
    warnings.warn(
        f"keras_mp: the train step assigns to the {half} weights of "
        f"`{name}` ({type(held).__name__} {held.name!r}), which no optimizer "
        f"trains (an EMA copy?). In {half} an update smaller than {spacing} "
        f"of a weight rounds away, so an average with a decay of 0.999 keeps "
        f"a fraction of its updates. Keep `{name}` in float32 (it is not "
        f"trained: no optimizer memory): `amp_deny=[model.{name}]` in "
        f"compile (`deny=` in apply_amp), and cast what you assign from "
        f"the {half} network to its dtype: `ema_weight.assign(ema * "
        f"ema_weight + (1 - ema) * ops.cast(weight, ema_weight.dtype))`.",
        stacklevel=stacklevel,
    )
