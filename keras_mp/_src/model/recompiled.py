"""A built optimizer given to `compile(amp_level=...)` again: built for the
variables as they were, it trains them as they are now.

An optimizer is built once, for one set of variables, as Keras has it. A
second `compile` that changes the level or the dtype recasts the model's
variables in place (O3 bfloat16 -> O2: float32), and the optimizer the
user passes again (`optimizer=opt`, `optimizer=model.optimizer`) was built
for them as they were: TensorFlow finds them no more ("Unknown variable"),
a float32 variable kept its float32 copy and Adam's slots their half
dtype, and a LossScaleOptimizer built for float32 variables has no copy
for the half ones O3 makes, so their weights stopped moving. An inner
optimizer wrapped at the previous level was refused by the wrapper the new
level needs ("already wrapped").

Such an optimizer is replaced by a new one of the same class and settings,
wrapped as the level needs and built for the same variables, and it takes
the state over: the inner optimizer's iterations and slots (cast to their
new dtypes), the weights as the old float32 copies held them (not as the
recast rounded them), and a dynamic scale's state. keras_mp says so: the
user's reference to the old optimizer no longer trains the model.
"""

import typing
import warnings

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.optimizer.inner_optimizer import wrapper_of
from keras_mp._src.optimizer.loss_scale_optimizer import LossScaleOptimizer
from keras_mp._src.optimizer.master_weights import reconciled


class Kept(typing.NamedTuple):
    """What a built optimizer trained, read before `compile` changes the policies.

    `variables`: those it was built for (the model's, in order); `dtypes`:
    theirs then; `weights`: position -> the float32 weight its master copy
    held (O3); `wrapper`, `inner`: the LossScaleOptimizer (or None) and the
    optimizer it steps.
    """

    variables: list
    dtypes: list
    weights: dict
    wrapper: object
    inner: object


def kept(optimizer):
    """The `Kept` of the optimizer `compile` was given, or None: not built."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        wrapper, inner = optimizer, optimizer.inner_optimizer
    else:
        wrapper, inner = wrapper_of(optimizer), optimizer
    if not inner.built:
        return None
    if not isinstance(wrapper, LossScaleOptimizer) or not wrapper.built:
        wrapper = None
    variables = list(keras_internals.built_variables(wrapper or inner))
    masters = None if wrapper is None else wrapper._masters
    weights = {}
    if masters is not None:
        for i, copy in masters.copies.items():
            weights[i] = reconciled(copy.value, variables[i].value)
    dtypes = [keras.backend.standardize_dtype(v.dtype) for v in variables]
    return Kept(variables, dtypes, weights, wrapper, inner)


def compiled_optimizer(given, before, wrap, wrapped_otherwise):
    """The optimizer `compile` trains with: `wrap(given)` (the level's
    wrapper), or where `given` cannot train the model as it is now, `wrap`
    of a new one that takes its state over (`before`: `kept(given)`, read
    before the policies changed; `wrapped_otherwise`: `given` is the inner
    optimizer of a wrapper that `wrap` would not return)."""
    recast = before is not None and any(
        keras.backend.standardize_dtype(v.dtype) != d
        for v, d in zip(before.variables, before.dtypes)
    )
    if not recast and not wrapped_otherwise:
        return wrap(given)
    fresh = wrap(_same_settings(given, recast))
    old = type(getattr(given, "inner_optimizer", given)).__name__
    carried = "unbuilt, as the one passed"
    if before is not None:
        with backends.current.outside_the_step():
            fresh.build(before.variables)
            carried = _take_over(before, fresh)
    why = (
        f"`compile` recast the variables the {old} passed to it was built for ({_change(before)})"
        if recast
        else f"the {old} passed to `compile` is wrapped for the previous level, "
        "and a LossScaleOptimizer of other settings cannot wrap it too"
    )
    warnings.warn(
        f"keras_mp: {why}: the model trains with a new {old} of the same "
        f"settings, {carried}. Use `model.optimizer` from now on.",
        stacklevel=3,  # the user's `compile`
    )
    return fresh


def _same_settings(given, recast):
    """A new, unbuilt optimizer of `given`'s class and settings (a
    LossScaleOptimizer with a new inner optimizer)."""
    try:
        return type(given).from_config(given.get_config())
    except Exception as error:
        what = "recast the variables it was built for" if recast else "wraps it anew"
        raise ValueError(
            f"compile(amp_level=...) {what}, so it needs a new optimizer of the "
            f"same settings, and {type(given).__name__}.from_config(get_config()) "
            f"failed ({type(error).__name__}: {error}). Pass a new optimizer: "
            f"`model.compile(optimizer={type(given).__name__}(...), ...)`."
        ) from error


def _take_over(before, fresh):
    """Gives `fresh` (built) the state of the optimizer `before` describes;
    returns what it took, in words."""
    inner = getattr(fresh, "inner_optimizer", fresh)
    masters = getattr(fresh, "_masters", None)
    copies = {} if masters is None else masters.copies
    # Copies of the values (JAX: a cast to the same dtype is the same array,
    # which a step donating both would donate twice).
    for i, weight in before.weights.items():
        variable = before.variables[i]
        variable.assign(ops.copy(ops.cast(weight, variable.dtype)))
        if i in copies:
            copies[i].assign(ops.copy(weight))
    old, new = before.inner.variables, inner.variables
    if len(old) == len(new) and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(old, new)):
        for a, b in zip(old, new):
            b.assign(ops.copy(ops.cast(a.value, b.dtype)))
        taken = "built for the variables as they are now, its iterations and slots carried over"
    else:
        inner.iterations.assign(ops.copy(before.inner.iterations.value))
        taken = (
            "built for the variables as they are now, its iterations carried "
            "over (its slots start anew: they differ in layout)"
        )
    wrapper = before.wrapper
    if isinstance(fresh, LossScaleOptimizer) and wrapper is not None:
        state = zip(wrapper._state_variables(), fresh._state_variables())
        for k, (a, b) in enumerate(state):
            if k == 2 or (wrapper.dynamic and fresh.dynamic):  # a scale is not another's
                b.assign(ops.copy(a.value))
    if before.weights:
        taken += ", the weights as their float32 copies held them"
    return taken


def _change(before):
    changed = sorted(
        {
            f"{d} -> {keras.backend.standardize_dtype(v.dtype)}"
            for v, d in zip(before.variables, before.dtypes)
            if keras.backend.standardize_dtype(v.dtype) != d
        }
    )
    return ", ".join(changed)
