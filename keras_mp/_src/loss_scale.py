"""The loss-scale state machine, written once.

Every execution path of `keras_mp.LossScaleOptimizer` (stateful TensorFlow,
stateless JAX, distributed) computes the next state with `update` below and
only stores the result. PyTorch, which knows the outcome on the host, mirrors
it with in-place torch ops (`LossScaleOptimizer._torch_update_in_place`);
the reference tests drive both. `update` is a pure function built from
`keras.ops` selects, so it traces under `tf.function`, XLA and `jax.jit` alike
and never needs the host to look at a tensor.
"""

import dataclasses
from typing import NamedTuple

from keras import ops


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """The static settings of a loss scale (Python values, never tensors).

    Validation lives in `LossScaleOptimizer.__init__`; this is plain data.
    """

    dynamic: bool = True
    dynamic_growth_steps: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    skip_on_overflow: bool = True

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
            scale = max(scale * backoff_factor, min_scale)
    ```

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
    skipped_steps = select(
        finite, lambda: skipped_steps, lambda: skipped_steps + 1
    )
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
                lambda: ops.maximum(
                    scale * config.backoff_factor, config.min_scale
                ),
            ),
        )
        good_steps = select(grow, zero, lambda: good_steps)
    return LossScaleState(scale, good_steps, skipped_steps)
