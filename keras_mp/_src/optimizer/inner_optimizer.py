"""What keras_mp does with the optimizer a LossScaleOptimizer wraps.

- Arguments: clipping, weight decay, EMA and gradient accumulation belong to
  the inner optimizer (it sees unscaled gradients); the wrapper refuses them.
- One wrapper per inner optimizer, as tf.keras 2 had it.
- Clipping over float32 and half gradients at once (`clip_in_float32`).

Keras's optimizers clip as if every gradient had one dtype: `global_clipnorm`
stacks the per-variable squared norms and multiplies each gradient by one
float32 scale, which TensorFlow refuses when O3 leaves some variables float32
(BatchNorm with `keep_batchnorm_fp32`, the output layer) beside half ones.
A squared norm summed in float16 also overflows once the norm passes 256.
keras_mp has the optimizer clip float32 copies of half gradients and cast
the results back, the way Apex computes its norms in float32: the clipped
gradients and everything after them (accumulators, update step) keep their
dtypes.
"""

import weakref

import keras

from keras_mp._src import keras_internals

_MARK = "_keras_mp_clips_in_float32"


def clip_in_float32(optimizer):
    """Makes `optimizer` clip half gradients in float32 (idempotent)."""
    if getattr(optimizer, _MARK, False) or not hasattr(optimizer, "_clip_gradients"):
        return optimizer
    keras_clip = optimizer._clip_gradients  # the bound method of its class

    def clip_gradients(grads):
        clips = optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue
        dtypes = [None if g is None else keras.backend.standardize_dtype(g.dtype) for g in grads]
        if not clips or all(d in (None, "float32", "float64") for d in dtypes):
            return keras_clip(grads)  # no casts where nothing is clipped
        up = [
            g if d in (None, "float32", "float64") else keras.ops.cast(g, "float32")
            for g, d in zip(grads, dtypes)
        ]
        clipped = keras_clip(up)
        return [
            c if d in (None, "float32", "float64") else keras.ops.cast(c, d)
            for c, d in zip(clipped, dtypes)
        ]

    optimizer._clip_gradients = clip_gradients
    setattr(optimizer, _MARK, True)
    return optimizer


# Arguments of the base optimizer that only make sense on the inner optimizer.
# Their defaults are accepted (configs saved by older Keras versions carry
# them); anything else is refused with a pointer to the inner optimizer.
INNER_ONLY_ARGUMENTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def check_inner_only_arguments(kwargs):
    for arg_name, default in INNER_ONLY_ARGUMENTS.items():
        if arg_name not in kwargs:
            continue
        value = kwargs.pop(arg_name)
        if value is not default and value != default:
            raise ValueError(
                f"LossScaleOptimizer does not support `{arg_name}`. "
                f"Instead, set `{arg_name}` on the `inner_optimizer`. "
                f"Received: {arg_name}={value!r}"
            )
    if kwargs:
        raise ValueError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs.keys())}`."
        )


def check_inner_setting(wrapper, name, value):
    """Refuses `wrapper.<name> = value` for a setting of the inner optimizer.

    Set on the wrapper, it would change the wrapper's own, unused copy: the
    inner optimizer sees the unscaled gradients and does the clipping, EMA
    and so on.
    """
    if name in INNER_ONLY_ARGUMENTS and value != getattr(wrapper, name, INNER_ONLY_ARGUMENTS[name]):
        raise ValueError(
            f"LossScaleOptimizer does not take `{name}`: set it on the "
            f"inner optimizer ({type(wrapper.inner_optimizer).__name__}), "
            f"before the first step: `optimizer.inner_optimizer.{name} = "
            f"{value!r}`. Received: {name}={value!r}"
        )


_WRAPPER_ATTRIBUTE = "_keras_mp_loss_scale_wrapper"


def mark_wrapped(inner_optimizer, wrapper):
    """Records `wrapper` on `inner_optimizer` (a weak reference)."""
    object.__setattr__(inner_optimizer, _WRAPPER_ATTRIBUTE, weakref.ref(wrapper))


def wrapper_of(optimizer):
    """The live keras_mp LossScaleOptimizer wrapping `optimizer`, or None."""
    ref = getattr(optimizer, _WRAPPER_ATTRIBUTE, None)
    return None if ref is None else ref()


def check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a LossScaleOptimizer; wrapping it "
            "again would scale the loss twice. Pass its `inner_optimizer`, or "
            "use it as it is. Received: "
            f"inner_optimizer={type(inner_optimizer).__name__}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance "
            "(e.g. `keras.optimizers.Adam()`). Received: "
            f"inner_optimizer={inner_optimizer!r} of type "
            f"{type(inner_optimizer).__name__}"
        )
    if wrapper_of(inner_optimizer) is not None:
        raise ValueError(
            "`inner_optimizer` is already wrapped by another LossScaleOptimizer "
            f"({wrapper_of(inner_optimizer).name!r}); an optimizer can be "
            "wrapped by one only, as in tf.keras 2 (two would both step it, "
            "each with its own scale). Use that LossScaleOptimizer, or wrap a "
            "new inner optimizer. Received: "
            f"inner_optimizer={type(inner_optimizer).__name__}"
            f"(name={inner_optimizer.name!r})"
        )


class _KeptUnlessScope(keras.StatelessScope):
    """A stateless scope whose every assignment keeps the variable's value
    from before the scope where `kept` is False."""

    def __init__(self, state_mapping, kept):
        super().__init__(state_mapping=state_mapping)
        self._kept = kept
        self._before = dict(self.state_mapping)

    def add_update(self, update):
        variable, value = update
        before = self._before.get(id(variable))
        if before is not None:
            value = keras.ops.where(self._kept, value, before)
        super().add_update((variable, value))


def stateless_apply_kept_if(optimizer, kept, optimizer_values, grads, trainable_values):
    """`optimizer.stateless_apply`, each assignment kept only where `kept`.

    The same values as `stateless_apply` followed by `where(kept, new, old)`
    on each returned value, but chosen where each is assigned, so that what
    is computed after an assignment reads the chosen value: Adam's weight
    update reads its new moments as they are written, as in the plain step.
    Selecting at the end instead has the weight update recompute the new
    moments from the old ones while the moments are written in place, and
    XLA copies every moment buffer first (`benchmarks/hlo_census.py`).
    """
    built = keras_internals.built_variables(optimizer)
    mapping = list(zip(built, trainable_values)) + list(zip(optimizer.variables, optimizer_values))
    with _KeptUnlessScope(mapping, kept) as scope:
        optimizer.apply(grads)
    return (
        [scope.get_current_value(v) for v in built],
        [scope.get_current_value(v) for v in optimizer.variables],
    )
