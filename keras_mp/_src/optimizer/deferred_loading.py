"""Optimizer state loaded before the optimizer is built, given to it at build.

An optimizer is built at its first step: a GAN's `d_optimizer`, or any
optimizer whose weights `load_weights` loads before the model trains again.
Keras skips those ("the optimizer has not been called/built yet") and the
run resumes from a fresh state (the loss scale back at 2**15, Adam's moments
at zero). keras_mp's `LossScaleOptimizer` keeps the saved values and gives
them to its variables when it is built, as `tf.train.Checkpoint` restores
what it cannot yet place.
"""

import numpy as np

from keras_mp._src import backends

_DEFERRED = "_keras_mp_deferred_values"


def keep_for_build(optimizer, store):
    """Keeps `store`'s values for `optimizer`'s build, if it is not built yet
    and the store holds more than its variables so far. Returns whether it did.
    """
    if optimizer.built or len(store.keys()) <= len(optimizer.variables):
        return False
    values = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
    object.__setattr__(optimizer, _DEFERRED, values)
    # Its own first variables (iterations, the learning rate, the loss scale
    # and counters) exist already and come first in the saved list too: now,
    # so that the first step scales its loss by the saved scale, before
    # `apply` builds the rest.
    for variable, value in zip(optimizer._variables, values):
        variable.assign(value)
    return True


def load_unbuilt_save(optimizer, store):
    """Loads the state of an optimizer saved before its first step into one
    that is built: a model saved before training and loaded (`load_model`
    builds the optimizer, as Keras's `compile_from_config` does) got Keras's
    "Skipping variable loading for optimizer" for it, and its loss scale
    and learning rate were not loaded. Such a save holds the variables an
    optimizer has before it is built, which a built one holds first: the
    wrapper's own (iterations, learning rate, loss scale and counters),
    then, for a LossScaleOptimizer, its inner optimizer's. Returns whether
    it did; a store that is not such a save is left to Keras (its warning).
    """
    if not optimizer.built or len(store.keys()) >= len(optimizer.variables):
        return False
    values = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
    own = list(optimizer._variables)
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        own = own[: optimizer._state_start + 3]
        targets = own + list(inner.variables)[: len(values) - len(own)]
    else:
        targets = own[: len(values)]
    if len(targets) != len(values) or any(
        tuple(t.shape) != v.shape for t, v in zip(targets, values)
    ):
        return False
    with backends.current.outside_the_step():
        for variable, value in zip(targets, values):
            variable.assign(value)
    return True


def load_kept(optimizer, load_own_variables):
    """At the end of `optimizer`'s build: loads what `keep_for_build` kept."""
    deferred = optimizer.__dict__.pop(_DEFERRED, None)
    if deferred is not None:
        with backends.current.outside_the_step():
            load_own_variables({str(i): v for i, v in enumerate(deferred)})


def defer_inner_loading(inner_optimizer):
    """The inner optimizer's variables are among the wrapper's, saved and
    loaded with them (`load_own_variables`); saved again on their own, they
    are left to the wrapper where the inner optimizer is not built yet,
    rather than skipped with Keras's warning."""
    load = inner_optimizer.load_own_variables

    def load_unless_deferred(store):
        if not inner_optimizer.built and len(store.keys()) > len(inner_optimizer.variables):
            return
        if load_unbuilt_save(inner_optimizer, store):
            return
        load(store)

    object.__setattr__(inner_optimizer, "load_own_variables", load_unless_deferred)
