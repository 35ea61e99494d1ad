"""`keras_mp.LossScaleOptimizer`: fixed and dynamic loss scaling."""

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.optimizer import deferred_loading
from keras_mp._src.optimizer import low_precision_state
from keras_mp._src.optimizer import serialization
from keras_mp._src.optimizer import skipped_state
from keras_mp._src.optimizer import stateless
from keras_mp._src.optimizer import tf_keras_names
from keras_mp._src.optimizer import unscaled_loss
from keras_mp._src.optimizer import zero
from keras_mp._src.optimizer.compensated import CompensatedUpdates
from keras_mp._src.optimizer.inner_optimizer import check_inner_only_arguments
from keras_mp._src.optimizer.inner_optimizer import check_inner_optimizer
from keras_mp._src.optimizer.inner_optimizer import check_inner_setting
from keras_mp._src.optimizer.inner_optimizer import clip_in_float32
from keras_mp._src.optimizer.inner_optimizer import mark_wrapped
from keras_mp._src.optimizer.loss_scale import ReadOnlySettings
from keras_mp._src.optimizer.loss_scale import Step
from keras_mp._src.optimizer.loss_scale import checked_growth_steps
from keras_mp._src.optimizer.loss_scale import config_from_arguments
from keras_mp._src.optimizer.master_weights import COMPENSATED
from keras_mp._src.optimizer.master_weights import MasterWeights
from keras_mp._src.optimizer.master_weights import check_master_weights
from keras_mp._src.optimizer.master_weights import float32_grads_of
from keras_mp._src.optimizer.scaled_loss import ScaleLoss

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
# The wrapper's own bookkeeping, plain Python values (see `__init__`).
_STEP_FLAGS = frozenset(
    (
        "_applies",
        "_grads_unscaled_by_caller",
        "_host_skips",
        "_loss_ever_scaled",
        "_loss_scaled_outside_fit",
        "_scale_is_the_steps",
        "_scaled_this_step",
        "_warned_unscaled_loss",
    )
)


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(
    ReadOnlySettings,
    ScaleLoss,
    stateless.StatelessApply,
    skipped_state.RestoreOnSkipMethod,
    tf_keras_names.TfKeras2Names,
    serialization.ConfigRoundTrip,
    _KerasLossScaleOptimizer,
):
    """An optimizer that scales the loss so float16 gradients do not underflow.

    Small gradients underflow to zero in float16. Multiplying the loss by a
    scale multiplies every gradient by it too, lifting them into float16's
    range; the optimizer divides them by the same scale (in float32) before
    the inner optimizer sees them. A scale that is too large overflows to inf
    instead, so each step is checked, and a step whose gradients are not finite
    is skipped: weights, the inner optimizer's slots and `iterations` stay as
    they were, bit for bit. So is a step whose loss is not finite
    (`scale_loss` makes its gradients NaN): an `inf` prediction's finite MAE
    gradient moves nothing.

    One step, as the state machine (the same on every
    backend):

    ```
    if not (dynamic or skip_on_overflow) or all(isfinite(g) for g in grads):
        inner_optimizer.apply([g / loss_scale for g in grads])   # float32
        good_steps += 1
        if dynamic and good_steps == dynamic_growth_steps:
            loss_scale = min(loss_scale * growth_factor, max_scale)
            good_steps = 0
    else:                                   # the step is skipped
        skipped_steps += 1
        good_steps = 0
        if dynamic:   # floor: min_scale, or 2**-126 with min_scale=None
            loss_scale = max(loss_scale * backoff_factor, floor)
    ```

    It is a drop-in for `keras.optimizers.LossScaleOptimizer` (and
    `isinstance` of it, so `compile` never wraps it again); unlike the
    built-in, it also takes tf.keras 2's `dynamic=False, initial_scale=...`
    for a fixed scale, and its scale never reaches 0.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` instance to wrap. Set
            clipping, weight decay, EMA and gradient accumulation on it: it
            sees unscaled gradients.
        dynamic: bool. `True` adjusts the scale as above; `False` keeps
            `initial_scale` fixed.
        initial_scale: float in [2**-126, 2**126]. The scale of the first step. A high value
            is recommended for a dynamic scale: an overflow lowers it at once,
            growth takes `dynamic_growth_steps` steps. `None` means `2**15`.
        dynamic_growth_steps: int >= 1 (a float with an integer value, such
            as `3.0`, is taken as that int). Finite steps in a row before the
            dynamic scale grows. `None` means 2000 with a dynamic scale; with
            `dynamic=False` it must be left out (or `None`), as in tf.keras 2,
            and it reads `None`.
        growth_factor: float > 1. What the scale is multiplied by on growth.
        backoff_factor: float in (0, 1). What the scale is multiplied by after
            a non-finite step.
        min_scale: `None` (no floor: the scale falls as low as the gradients
            need, as in Keras 3 and `torch.amp.GradScaler`; a regression on
            unnormalised targets needs one below 1) or a float in
            [2**-126, 2**126] that the dynamic scale never goes below
            (tf.keras 2's was 1). Either way the scale stays at or above
            2**-126, the smallest normal float32, so it never reaches 0.
        max_scale: float in [`min_scale`, 2**126]. The dynamic scale never goes above
            this.
        skip_on_overflow: bool. Fixed scale only: `False` applies every step
            without looking at the gradients (no check, no skip).
        master_weights: `True`, `False` or `"compensated"`. `True` updates
            each float16/bfloat16 trainable variable through a float32 copy
            kept in this optimizer (the inner optimizer is built on the
            copies, so its slots are float32 too) and assigns the variable
            the copy's rounding, as Apex's and DeepSpeed's master weights.
            Without it, updates below a half weight's spacing are lost.
            Float32 variables need no copy. `"compensated"` keeps no copy:
            each bfloat16 variable gets a bfloat16 buffer of what the
            rounding of its updates lost (Kahan summation; 2 bytes a weight
            instead of 4, and the slots stay bfloat16), with steps computed
            in float32. For bfloat16 variables and an inner `Adam`, `AdamW`
            or `SGD`.
        shard_optimizer_state: bool. `True` (JAX, under a
            `keras.distribution` with a batch axis) shards the master copies
            and the inner optimizer's slots over the data-parallel replicas
            as well as their variables' layout (ZeRO stage 1, `zero.py`).
        moment_dtypes: None, `"float8"` or a pair `(first, second)`. An
            inner `Adam` or `AdamW` keeps its first moment in the first
            dtype (`"float8"`: E4M3 with a per-tensor scale; `"float16"`,
            `"bfloat16"`, `"float32"`) and its second moment in the second
            (`"float16"` with a per-tensor scale, `"bfloat16"`,
            `"float32"`); `"float8"` is `("float8", "float16")`, MS-AMP's
            O2: 3 bytes of state a weight instead of 8, the update computed
            in float32. Any level.
        name: string or `None`. The optimizer's name.

    Example:

    >>> import keras, keras_mp
    >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    >>> float(opt.loss_scale.numpy())
    32768.0

    Custom training loops: `opt.scale_loss(loss)` inside the gradient tape,
    then `opt.apply(grads, variables)`; one per backend in
    `examples/custom_training_loop.py`.

    Note:
        The state is three optimizer variables, saved and restored with it:
        `loss_scale` (float32), `good_steps` and `skipped_steps` (also
        readable as Keras's `dynamic_scale`, `step_counter` and tf.keras 2's
        `dynamic_counter`). No host synchronisation on TensorFlow and JAX;
        PyTorch reads one flag per step, as `torch.amp.GradScaler`.
    """

    def __init__(
        self,
        inner_optimizer,
        dynamic=True,
        initial_scale=2.0**15,
        dynamic_growth_steps=None,
        *,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=None,
        max_scale=2.0**24,
        skip_on_overflow=True,
        master_weights=True,
        shard_optimizer_state=False,
        moment_dtypes=None,
        name=None,
        **kwargs,
    ):
        check_inner_only_arguments(kwargs)
        check_inner_optimizer(inner_optimizer)
        moment_dtypes = low_precision_state.check(inner_optimizer, moment_dtypes, master_weights)
        if initial_scale is None:
            initial_scale = 2.0**15
        dynamic_growth_steps = checked_growth_steps(dynamic, dynamic_growth_steps)
        config = config_from_arguments(
            dynamic=dynamic,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps or 2000,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            skip_on_overflow=skip_on_overflow,
        )
        check_master_weights(master_weights)
        zero.check_argument(shard_optimizer_state)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a string or None. Received: name={name!r}")
        # Keras's built-in __init__ refuses `dynamic=False`; skip it and set up
        # the base optimizer directly.
        super(_KerasLossScaleOptimizer, self).__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        # One wrapper per inner optimizer, as in tf.keras 2: two would both
        # step it, each with its own scale.
        mark_wrapped(inner_optimizer, self)
        deferred_loading.defer_inner_loading(inner_optimizer)
        # The loss is scaled here; scaling it in the inner optimizer as well
        # would scale it twice.
        self.inner_optimizer.loss_scale_factor = None
        clip_in_float32(self.inner_optimizer)
        self._config = config
        self._master_weights = master_weights
        self._shard_optimizer_state = shard_optimizer_state
        self._moment_dtypes = moment_dtypes
        self._masters = None  # the float32 copies, made at `build`
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = dynamic_growth_steps
        self._grads_unscaled_by_caller = False
        # Whether `scale_loss` was ever called (the unscaled-loss warnings);
        # read when a step is traced or run, never from a tensor.
        self._loss_ever_scaled = False
        # ... outside a `fit` step (a loop of the user's own, `unscaled_loss.py`).
        self._loss_scaled_outside_fit = False
        self._warned_unscaled_loss = False
        # Inside a `fit` step (set by its train step, `train_step.py`): whether
        # the loss reached `scale_loss` in this step; None outside one.
        self._scaled_this_step = None
        # Where the model holds it, for logs and messages (`wrapping.name_in_logs`).
        self._keras_mp_label = "optimizer"
        # How many times `apply`/`stateless_apply` ran in Python (traced or
        # run): which optimizers a step of the model's own uses (the logs).
        self._applies = 0
        # How many steps this process skipped where the backend decides on
        # the host (PyTorch's eager step, `backends.torch.apply`): the train
        # step restores the model's state from it, with no tensor op.
        self._host_skips = 0
        # JAX: whether the last `scale_loss` read the step's own scale (in a
        # StatelessScope) rather than the variable's value at trace time.
        self._scale_is_the_steps = True
        self._warned_constant_scale = False
        self._stateless_cache = {}  # the backend's (JAX: the step compiled once)

        # The state is created here, not in `build`, so that `loss_scale`
        # exists (and `scale_loss` works) before the first step.
        self._state_start = len(self._variables)
        self.loss_scale, self.good_steps, self.skipped_steps = (
            self.add_variable((), initializer, dtype, aggregation="none", name=name)
            for name, dtype, initializer in (
                ("loss_scale", "float32", keras.initializers.Constant(self.initial_scale)),
                ("good_steps", "int", "zeros"),
                ("skipped_steps", "int", "zeros"),
            )
        )

    moment_dtypes = property(lambda self: self._moment_dtypes, doc="Adam's moments' dtypes.")

    def __setattr__(self, name, value):
        if name in _STEP_FLAGS:
            # Python values set at every step: Keras's tracking has nothing
            # to track in them, and on a small model its walk is measurable.
            object.__setattr__(self, name, value)
            return
        # `lso.use_ema = True` would set the wrapper's own, unused copy.
        if "_config" in self.__dict__:  # after the base `__init__` set the defaults
            check_inner_setting(self, name, value)
        super().__setattr__(name, value)

    # -- building ------------------------------------------------------------

    @keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:  # as Keras's optimizers: built once, for one set of variables
            return
        var_list = list(var_list)
        skip = self._skip_indices(var_list)
        targets = var_list
        layout_of, laid_out = zero.layouts(self.inner_optimizer, self._shard_optimizer_state)
        if self.master_weights is True:
            masters = MasterWeights(self, var_list, skip=skip, layout_of=layout_of)
            if masters:
                self._masters = masters
                targets = masters.targets(var_list)
        if self._moment_dtypes is not None:
            moments = low_precision_state.LowPrecisionMoments(
                self.inner_optimizer, self._moment_dtypes
            )
            laid_out = moments.building(layout_of)
        with laid_out:
            self.inner_optimizer.build(targets)
        if self._masters is not None:
            self._masters.exclude_copies_like(self.inner_optimizer, var_list)
        elif self.master_weights == COMPENSATED:
            CompensatedUpdates(self.inner_optimizer, var_list, skip=skip, layout_of=layout_of)
        # The base optimizer's build (Keras's built-in's makes a second state).
        super(_KerasLossScaleOptimizer, self).build(var_list)
        deferred_loading.load_kept(self, super().load_own_variables)

    def load_own_variables(self, store):
        """Loads the saved state; before the optimizer is built, at its build
        (`deferred_loading.py`)."""
        if not (
            deferred_loading.keep_for_build(self, store)
            or deferred_loading.load_unbuilt_save(self, store)
        ):
            super().load_own_variables(store)

    def _state_variables(self):
        return self._variables[self._state_start : self._state_start + 3]

    def _skip_indices(self, trainable_variables):
        overwritten = self._overwrite_variable_with_gradient
        return {i for i, v in enumerate(trainable_variables) if overwritten(v)}

    # -- the step ---------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Applies one step of scaled gradients (see the class docstring).

        Args:
            grads: list of gradients of the scaled loss, one per variable.
            trainable_variables: list of variables; optional once built.
        """
        grads = list(grads)
        self._applies += 1
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        # (No `:=` here: AutoGraph, which converts `apply` in a user's
        # `tf.function`, cannot transform it and says so in the log.)
        taker = float32_grads_of(self)
        if taker is not None:
            grads = taker.filled(grads, trainable_variables)
        unscaled_by_caller = self._grads_unscaled_by_caller
        self._grads_unscaled_by_caller = False
        if not unscaled_by_caller:
            unscaled_loss.warn_if_the_loss_was_never_scaled(self, "apply")

        finite = backends.current.apply(
            self._step(trainable_variables), grads, trainable_variables, unscaled_by_caller
        )
        if finite is False:  # known on the host (PyTorch); None elsewhere
            self._host_skips += 1

    def _step(self, trainable_variables):
        """The step's state and callables, for the backend's `apply`."""
        return Step(
            config=self._config,
            variables=self._state_variables(),
            check_finite=self.check_finite,
            skip=frozenset(self._skip_indices(trainable_variables)),
            apply_inner=self._apply_inner,
            stateless_apply=self.stateless_apply,
            # Only a stateless backend's eager `apply` reads these two: not
            # gathered on every step of a stateful one.
            optimizer_variables=tuple(self.variables) if backends.current.STATELESS else (),
            built_variables=tuple(self._trainable_variables) if backends.current.STATELESS else (),
            inner_stateless_apply=self._inner_stateless_apply,
            state_index=self._state_start,
            own_count=len(self._variables),
            loss_unscaled=self._scaled_this_step is False,
            unit_scale=self._unit_scale,
        )

    def _apply_inner(self, grads, trainable_variables):
        if self._masters is None:
            self.inner_optimizer.apply(grads, trainable_variables)
        else:
            self._masters.apply(
                self.inner_optimizer.apply, grads, trainable_variables, self._get_variable_index
            )

    def finalize_variable_values(self, var_list):
        if not keras_internals.hold_values(var_list):  # a JAX `fit` that failed
            return
        if self._masters is None:
            self.inner_optimizer.finalize_variable_values(var_list)
        else:
            self._masters.finalize(
                self.inner_optimizer.finalize_variable_values, var_list, self._get_variable_index
            )

    def check_finite(self, grads):
        """Boolean scalar tensor: whether all gradients are finite."""
        return backends.current.all_finite(grads)
