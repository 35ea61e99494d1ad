"""The loss-scale state machine, written once.

Every execution path of `keras_mp.LossScaleOptimizer` (stateful TensorFlow,
stateless JAX, distributed) computes the next state with `update` below and
only stores the result. PyTorch, which knows the outcome on the host, runs the
same transition as in-place torch ops (`backends.torch.update_in_place`, kept
because `update` through `keras.ops` is measurably slower per eager step);
`test_torch_in_place_update_agrees_with_update` checks every transition.
`update` is a pure function built from `keras.ops` selects, so it traces under
`tf.function`, XLA and `jax.jit` alike and never needs the host to look at a
tensor.
"""

import dataclasses
import math
import numbers
from typing import NamedTuple

from keras import ops

# The largest scale: gradients are multiplied by its reciprocal, which above
# 2**126 is no longer a normal float32 (a device that flushes subnormals to
# zero would zero every gradient).
MAX_SCALE = 2.0**126
# The lowest scale, whatever `min_scale` says (None: no floor of the user's):
# the smallest normal float32. Below it the scale would be a subnormal that
# a device flushing them makes 0, and a scale of 0 never comes back (0 times
# the growth factor is 0): every step would be "finite" with zero gradients,
# or, divided by 0, never finite again (Keras 3's and torch.amp's scales fall
# to 0 after about 150 overflows in a row).
MIN_SCALE = 2.0**-126
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """The static settings of a loss scale (Python values, never tensors).

    Made from `LossScaleOptimizer`'s arguments by `config_from_arguments`,
    which checks them; the optimizer's `config` property returns it.
    """

    dynamic: bool = True
    dynamic_growth_steps: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float | None = None
    max_scale: float = 2.0**24
    skip_on_overflow: bool = True

    @property
    def floor(self):
        """The lowest the dynamic scale goes: `min_scale`, or with no floor
        of the user's (`None`) the smallest normal float32, 2**-126."""
        return MIN_SCALE if self.min_scale is None else self.min_scale

    @property
    def checks_finite(self):
        """Whether a step looks at its gradients before applying them."""
        return self.dynamic or self.skip_on_overflow


class LossScaleState(NamedTuple):
    """The dynamic part: three scalars (tensors or numbers)."""

    scale: object
    good_steps: object
    skipped_steps: object


def select(pred, on_true, on_false):
    """`ops.where(pred, on_true(), on_false())`, or one branch if `pred` is static.

    With a Python bool only the chosen branch is built: callers that already
    know the outcome (inside a `cond` branch, or after PyTorch's one host
    read) get the specialised transition, a handful of ops, from the same
    code.
    """
    if isinstance(pred, bool):
        return on_true() if pred else on_false()
    return ops.where(pred, on_true(), on_false())


def _logical_and(a, b_fn):
    if isinstance(a, bool):
        return b_fn() if a else False
    return ops.logical_and(a, b_fn())


def update(state, grads_finite, config):
    """Returns the state after one step.

    ```
    if grads_finite:
        good_steps += 1
        if dynamic and good_steps == dynamic_growth_steps:
            scale = min(scale * growth_factor, max_scale)
            good_steps = 0
    else:
        skipped_steps += 1
        good_steps = 0
        if dynamic:
            scale = max(scale * backoff_factor, floor)
    ```

    `floor` is `config.floor`: `min_scale`, or 2**-126 (the smallest normal
    float32) when `min_scale` is None.

    Written with selects rather than branches: one trace, no host sync. With
    a Python bool `grads_finite` the selects fold away and only that outcome's
    ops are built; entries that do not change are returned as the same
    objects, so callers can skip assigning them.

    Args:
        state: `LossScaleState` of scalar tensors (float32 scale, integer
            counters).
        grads_finite: boolean scalar tensor, or a Python bool.
        config: `LossScaleConfig`.

    Returns:
        The new `LossScaleState`.
    """
    scale, good_steps, skipped_steps = state
    finite = (
        grads_finite
        if isinstance(grads_finite, bool)
        else ops.convert_to_tensor(grads_finite, dtype="bool")
    )

    def zero():
        return ops.zeros_like(good_steps)

    good_steps = select(finite, lambda: good_steps + 1, zero)
    skipped_steps = select(finite, lambda: skipped_steps, lambda: skipped_steps + 1)
    if config.dynamic:
        grow = _logical_and(
            finite,
            lambda: ops.greater_equal(good_steps, config.dynamic_growth_steps),
        )
        scale = select(
            grow,
            lambda: ops.minimum(scale * config.growth_factor, config.max_scale),
            lambda: select(
                finite,
                lambda: scale,
                lambda: ops.maximum(scale * config.backoff_factor, config.floor),
            ),
        )
        good_steps = select(grow, zero, lambda: good_steps)
    return LossScaleState(scale, good_steps, skipped_steps)


class Step(NamedTuple):
    """What a backend's step needs from the optimizer, as data and callables.

    The backend modules (`keras_mp._src.backends`) run the step from this and
    never import the optimizer.

    Attributes:
        config: the `LossScaleConfig`.
        variables: the state's variables: `(loss_scale, good_steps,
            skipped_steps)`.
        check_finite: `grads -> boolean scalar tensor`.
        skip: indices of the gradients that are values, not gradients
            (variables with `overwrite_with_gradient`): never unscaled.
        apply_inner: `(grads, variables) -> None`, the inner optimizer's step
            (through the float32 master weights, if any).
        stateless_apply: `(optimizer_values, grads, trainable_values) ->
            (trainable_values, optimizer_values)` (JAX's eager `apply`).
        optimizer_variables: every variable of the optimizer, inner ones
            included, in `stateless_apply`'s order.
        built_variables: the trainable variables the optimizer was built with.
        inner_stateless_apply: `(own_values, inner_values, grads,
            trainable_values) -> (trainable_values, own_values,
            inner_values)`: the inner optimizer's `stateless_apply`, and
            the master weights' copies among the optimizer's own values.
        state_index: where the state's three values start among the
            optimizer's own values (`optimizer_variables`' first
            `own_count`; the inner optimizer's follow).
        loss_unscaled: the gradients are of a loss that never reached
            `scale_loss` in this step (a `train_step` of the user's own,
            inside `fit`): they are checked, and unscaled by 1.
        unit_scale: the scale is a fixed 1 (bfloat16's check, O3's master
            weights): nothing to unscale, only float32 to cast to.
    """

    config: LossScaleConfig
    variables: tuple
    check_finite: object
    skip: frozenset
    apply_inner: object
    stateless_apply: object = None
    optimizer_variables: tuple = ()
    built_variables: tuple = ()
    inner_stateless_apply: object = None
    state_index: int = 0
    own_count: int = 0
    loss_unscaled: bool = False
    unit_scale: bool = False


# -- the arguments, checked ----------------------------------------------------


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_bool(name, value, hint=""):
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a bool (True or False).{hint} Received: {name}={value!r}"
        )


def check_scale(name, value, none_means=""):
    """Refuses a scale outside [2**-126, 2**126]: the scale and its reciprocal
    (what gradients are multiplied by) must be normal float32 numbers."""
    if not _is_number(value) or not (MIN_SCALE <= value <= MAX_SCALE):
        raise ValueError(
            f"`{name}` must be a number of at least 2**-126 and at most "
            "2**126 (the scale and its reciprocal, which gradients are "
            "multiplied by, must be normal float32 numbers)"
            f"{none_means}. Received: {name}={value!r}"
        )


def checked_growth_steps(dynamic, steps):
    """`dynamic_growth_steps` as tf.keras 2 took it: an int, or None."""
    if steps is None:
        return 2000 if dynamic is True else None
    if dynamic is False:
        raise ValueError(
            "`dynamic_growth_steps` applies to a dynamic scale only; leave it "
            "out (or pass None) with `dynamic=False`. Received: "
            f"dynamic=False, dynamic_growth_steps={steps!r}"
        )
    whole = _is_number(steps) and math.isfinite(steps) and float(steps).is_integer() and steps >= 1
    if not whole:
        raise ValueError(
            "`dynamic_growth_steps` must be an integer >= 1 (or None: 2000). "
            f"Received: dynamic_growth_steps={steps!r}"
        )
    return int(steps)


def config_from_arguments(
    *,
    dynamic,
    initial_scale,
    dynamic_growth_steps,
    growth_factor,
    backoff_factor,
    min_scale,
    max_scale,
    skip_on_overflow,
):
    """The `LossScaleConfig` of `LossScaleOptimizer`'s arguments, checked.

    Every refusal names the argument, the value received and what is allowed.
    `dynamic_growth_steps` comes from `checked_growth_steps`.
    """
    _check_bool(
        "dynamic",
        dynamic,
        hint=(
            " The second positional argument is `dynamic`, as in tf.keras 2; "
            "pass `initial_scale=` by keyword."
            if _is_number(dynamic)
            else ""
        ),
    )
    _check_bool("skip_on_overflow", skip_on_overflow)
    check_scale("initial_scale", initial_scale)
    if not _is_number(growth_factor) or not (1 < growth_factor <= FLOAT32_MAX):
        raise ValueError(
            "`growth_factor` must be a finite number greater than 1. "
            f"Received: growth_factor={growth_factor!r}"
        )
    if not _is_number(backoff_factor) or not (0 < backoff_factor < 1):
        raise ValueError(
            "`backoff_factor` must be a number in the open interval (0, 1). "
            f"Received: backoff_factor={backoff_factor!r}"
        )
    if min_scale is not None:
        check_scale("min_scale", min_scale, none_means=", or None for no floor")
    check_scale("max_scale", max_scale)
    if min_scale is not None and min_scale > max_scale:
        raise ValueError(
            "`min_scale` must be less than or equal to `max_scale`. "
            f"Received: min_scale={min_scale!r}, max_scale={max_scale!r}"
        )
    if dynamic and not skip_on_overflow:
        raise ValueError(
            "`skip_on_overflow=False` is only allowed with a fixed scale "
            "(`dynamic=False`): a dynamic scale adjusts on overflowing steps, "
            "which it must detect. Received: dynamic=True, "
            "skip_on_overflow=False"
        )
    floor = MIN_SCALE if min_scale is None else min_scale
    if dynamic and not (floor <= initial_scale <= max_scale):
        raise ValueError(
            "With `dynamic=True`, `initial_scale` must lie in "
            f"[min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]. "
            f"Received: initial_scale={initial_scale!r}"
        )
    return LossScaleConfig(
        dynamic=dynamic,
        dynamic_growth_steps=int(dynamic_growth_steps),
        growth_factor=float(growth_factor),
        backoff_factor=float(backoff_factor),
        min_scale=None if min_scale is None else float(min_scale),
        max_scale=float(max_scale),
        skip_on_overflow=skip_on_overflow,
    )


class ReadOnlySettings:
    """The optimizer's settings, read-only: the `LossScaleConfig`'s fields and
    the wrapper's own (mixed into `LossScaleOptimizer`)."""

    @property
    def config(self):
        """The `LossScaleConfig` (read-only): the settings of the state machine."""
        return self._config

    @property
    def shard_optimizer_state(self):
        """Whether master copies and slots are sharded over the replicas."""
        return self._shard_optimizer_state

    @property
    def master_weights(self):
        """How half variables are updated: `True` (float32 copies), `False`, or
        `"compensated"` (bfloat16 compensation buffers)."""
        return self._master_weights

    # The settings, read-only (the config's fields).
    dynamic = property(lambda self: self._config.dynamic)
    growth_factor = property(lambda self: self._config.growth_factor)
    backoff_factor = property(lambda self: self._config.backoff_factor)
    min_scale = property(lambda self: self._config.min_scale)
    max_scale = property(lambda self: self._config.max_scale)
    skip_on_overflow = property(lambda self: self._config.skip_on_overflow)

    @property
    def _unit_scale(self):
        """A fixed scale of 1: nothing to unscale, nothing to warn of."""
        return not self._config.dynamic and self.initial_scale == 1.0
