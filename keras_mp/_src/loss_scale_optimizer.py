"""`keras_mp.LossScaleOptimizer`: fixed and dynamic loss scaling."""

import dataclasses
import functools
import warnings

import keras
import numpy as np
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.compensated import CompensatedUpdates
from keras_mp._src.inner_optimizer import check_inner_only_arguments
from keras_mp._src.inner_optimizer import check_inner_optimizer
from keras_mp._src.inner_optimizer import check_inner_setting
from keras_mp._src.inner_optimizer import clip_in_float32
from keras_mp._src.inner_optimizer import mark_wrapped
from keras_mp._src.inner_optimizer import stateless_apply_kept_if
from keras_mp._src.loss_scale import Step
from keras_mp._src.loss_scale import checked_growth_steps
from keras_mp._src.loss_scale import config_from_arguments
from keras_mp._src.master_weights import COMPENSATED
from keras_mp._src.master_weights import MasterWeights
from keras_mp._src.master_weights import check_master_weights

_KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer


def _defer_inner_loading(inner_optimizer):
    """The inner optimizer's variables are among the wrapper's, saved and
    loaded with them (`load_own_variables`); saved again on their own, they
    are left to the wrapper where the inner optimizer is not built yet,
    rather than skipped with Keras's warning."""
    load = inner_optimizer.load_own_variables

    def load_unless_deferred(store):
        if not inner_optimizer.built and len(store.keys()) > len(inner_optimizer.variables):
            return
        load(store)

    object.__setattr__(inner_optimizer, "load_own_variables", load_unless_deferred)


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(_KerasLossScaleOptimizer):
    """An optimizer that scales the loss so float16 gradients do not underflow.

    Small gradients underflow to zero in float16. Multiplying the loss by a
    scale multiplies every gradient by it too, lifting them into float16's
    range; the optimizer divides them by the same scale (in float32) before
    the inner optimizer sees them. A scale that is too large overflows to inf
    instead, so each step is checked, and a step whose gradients are not finite
    is skipped: weights, the inner optimizer's slots and `iterations` stay as
    they were, bit for bit.

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
        if dynamic:
            loss_scale = max(loss_scale * backoff_factor, min_scale)
    ```

    It is a drop-in for `keras.optimizers.LossScaleOptimizer` (and
    `isinstance` of it, so `compile` never wraps it again); unlike the
    built-in, it also takes tf.keras 2's `dynamic=False, initial_scale=...`
    for a fixed scale, and the dynamic scale never falls below `min_scale`.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` instance to wrap. Set
            clipping, weight decay, EMA and gradient accumulation on it: it
            sees unscaled gradients.
        dynamic: bool. `True` adjusts the scale as above; `False` keeps
            `initial_scale` fixed.
        initial_scale: float in (0, 2**126]. The scale of the first step. A high value
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
        min_scale: float in (0, 2**126]. The dynamic scale never goes below this.
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
        min_scale=1.0,
        max_scale=2.0**24,
        skip_on_overflow=True,
        master_weights=True,
        name=None,
        **kwargs,
    ):
        check_inner_only_arguments(kwargs)
        check_inner_optimizer(inner_optimizer)
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
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a string or None. Received: name={name!r}")
        # Keras's built-in __init__ refuses `dynamic=False`; skip it and set up
        # the base optimizer directly.
        super(_KerasLossScaleOptimizer, self).__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        # One wrapper per inner optimizer, as in tf.keras 2: two would both
        # step it, each with its own scale.
        mark_wrapped(inner_optimizer, self)
        _defer_inner_loading(inner_optimizer)
        # The loss is scaled here; scaling it in the inner optimizer as well
        # would scale it twice.
        self.inner_optimizer.loss_scale_factor = None
        clip_in_float32(self.inner_optimizer)
        self._config = config
        self._master_weights = master_weights
        self._masters = None  # the float32 copies, made at `build`
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = dynamic_growth_steps
        self._grads_unscaled_by_caller = False
        # Whether `scale_loss` was ever called (the unscaled-loss warnings);
        # read when a step is traced or run, never from a tensor.
        self._loss_ever_scaled = False
        self._warned_unscaled_loss = False
        # Inside a `fit` step (set by its train step, `train_step.py`): whether
        # the loss reached `scale_loss` in this step; None outside one.
        self._scaled_this_step = None
        # The model attribute that holds this optimizer (`d_optimizer`), for
        # messages and logs; set where keras_mp finds it (`wrapping.py`).
        self._keras_mp_label = "optimizer"
        # How many times `apply`/`stateless_apply` ran in Python (traced or
        # run): which optimizers a step of the model's own uses (the logs).
        self._applies = 0
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

    # -- configuration, read-only ------------------------------------------

    @property
    def config(self):
        """The `LossScaleConfig` (read-only): the settings of the state machine."""
        return self._config

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

    # Keras's built-in names for the state variables, and tf.keras 2's.
    dynamic_scale = property(lambda self: self.loss_scale)
    step_counter = property(lambda self: self.good_steps)
    # tf.keras 2: None for a fixed scale, which counts nothing towards growth.
    dynamic_counter = property(lambda self: self.good_steps if self._config.dynamic else None)

    def __setattr__(self, name, value):
        # `lso.use_ema = True` would set the wrapper's own, unused copy.
        if "_config" in self.__dict__:  # after the base `__init__` set the defaults
            check_inner_setting(self, name, value)
        super().__setattr__(name, value)

    # -- building ------------------------------------------------------------

    @keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        var_list = list(var_list)
        skip = self._skip_indices(var_list)
        targets = var_list
        if self.master_weights is True:
            masters = MasterWeights(self, var_list, skip=skip)
            if masters:
                self._masters = masters
                targets = masters.targets(var_list)
        self.inner_optimizer.build(targets)
        if self._masters is not None:
            self._masters.exclude_copies_like(self.inner_optimizer, var_list)
        elif self.master_weights == COMPENSATED:
            CompensatedUpdates(self.inner_optimizer, var_list, skip=skip)
        # The base optimizer's build (not the Keras built-in's, which would
        # create a second set of state variables).
        super(_KerasLossScaleOptimizer, self).build(var_list)
        deferred = self.__dict__.pop("_keras_mp_deferred_values", None)
        if deferred is not None:
            with backends.current.outside_the_step():
                super().load_own_variables({str(i): v for i, v in enumerate(deferred)})

    def load_own_variables(self, store):
        """Loads the saved state; before the optimizer is built, at its build.

        An optimizer is built at its first step: a GAN's `d_optimizer`, or
        any optimizer whose weights `load_weights` loads before the model
        trains again. Keras skips those ("the optimizer has not been
        called/built yet") and the run resumes from a fresh state (the loss
        scale back at 2**15, Adam's moments at zero). Here the saved values
        are kept and given to the variables when the optimizer is built, as
        `tf.train.Checkpoint` restores what it cannot yet place.
        """
        if not self.built and len(store.keys()) > len(self.variables):
            values = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
            object.__setattr__(self, "_keras_mp_deferred_values", values)
            # Its own first variables (iterations, the learning rate, the
            # loss scale and counters) exist already and come first in the
            # saved list too: now, so that the first step scales its loss
            # by the saved scale, before `apply` builds the rest.
            for variable, value in zip(self._variables, values):
                variable.assign(value)
            return
        super().load_own_variables(store)

    def _state_variables(self):
        return self._variables[self._state_start : self._state_start + 3]

    def _skip_indices(self, trainable_variables):
        return {
            i
            for i, v in enumerate(trainable_variables)
            if self._overwrite_variable_with_gradient(v)
        }

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
        unscaled_by_caller = self._grads_unscaled_by_caller
        self._grads_unscaled_by_caller = False
        if not unscaled_by_caller:
            self._warn_if_the_loss_was_never_scaled("apply")

        backends.current.apply(
            self._step(trainable_variables), grads, trainable_variables, unscaled_by_caller
        )

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

    def _inner_stateless_apply(self, own_values, inner_values, grads, trainable_values, kept=None):
        """`(new_trainable, new_own, new_inner)` values of an applied step.

        With `kept` (a boolean scalar), the inner optimizer's assignments
        are kept only where it is True (`stateless_apply_kept_if`).
        """
        inner_apply = self.inner_optimizer.stateless_apply
        if kept is not None:
            inner_apply = functools.partial(stateless_apply_kept_if, self.inner_optimizer, kept)
        if self._masters is None:
            new_trainable, new_inner = inner_apply(inner_values, grads, trainable_values)
            return list(new_trainable), list(own_values), list(new_inner)
        return self._masters.stateless_apply(
            inner_apply, own_values, inner_values, grads, trainable_values
        )

    def finalize_variable_values(self, var_list):
        if self._masters is None:
            self.inner_optimizer.finalize_variable_values(var_list)
        else:
            self._masters.finalize(
                self.inner_optimizer.finalize_variable_values, var_list, self._get_variable_index
            )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Stateless step: returns new trainable and optimizer variable values.

        Used by `model.fit` on JAX (under `jax.jit`); the decision to skip
        stays on the device: a `lax.cond` on a CPU, selects on a GPU or TPU
        (`backends.jax.skips_by_select` says why). Called with values rather
        than under a trace (`apply`, `fit(run_eagerly=True)`, a custom loop),
        the step is compiled with `jax.jit` at the first call.
        """
        backends.current.check_stateless()
        self._applies += 1
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {self.__class__.__name__} "
                "must be built (i.e. its variables must have been created). "
                "You can build it via `optimizer.build(trainable_variables)`."
            )
        optimizer_variables = list(optimizer_variables)
        if len(optimizer_variables) != len(self.variables):
            raise ValueError(
                "Argument `optimizer_variables` must be a list of tensors "
                f"corresponding 1:1 to {self.__class__.__name__}().variables. "
                f"Received list with length {len(optimizer_variables)}, but "
                f"expected {len(self.variables)} variables."
            )
        self._warn_if_the_loss_was_never_scaled("stateless_apply")
        self._warn_if_the_scale_was_a_constant(optimizer_variables)
        step = self._step(self._trainable_variables)
        return backends.current.run_stateless(
            functools.partial(backends.current.stateless_step, step),
            self._stateless_cache,
            optimizer_variables,
            grads,
            list(trainable_variables),
        )

    def _warn_if_the_loss_was_never_scaled(self, method):
        """Warns, once, of gradients applied while `scale_loss` never ran.

        Keras's own `train_step` scales the loss; a custom `train_step` or
        loop written without loss scaling in mind (Keras's "customizing
        fit" guide) does not, and its gradients, divided by a scale they
        were never multiplied by, make every update `loss_scale` times too
        small: the model does not train, and nothing says why. Whether
        `scale_loss` was ever called is known in Python (when the step is
        traced or run), so the check costs no step anything. Not "since the
        last step": a loss scaled in one `tf.function` and applied outside it
        is scaled only when that function is traced.
        """
        if self._unit_scale:
            return  # dividing by 1 changes nothing
        if self._scaled_this_step is False:
            self._warn_unscaled_in_a_train_step(method)
            return
        if self._loss_ever_scaled or self._warned_unscaled_loss:
            return
        self._warned_unscaled_loss = True
        warnings.warn(
            f"LossScaleOptimizer.{method} was called, but the loss was never "
            f"scaled: its gradients are divided by the loss scale "
            f"({self.initial_scale:g}) without having been multiplied by it, "
            "so every update is that many times too small and the model "
            "hardly trains. A custom `train_step` or training loop must scale "
            "the loss before taking its gradients, as Keras's own "
            "`train_step` does: `loss = self.optimizer.scale_loss(loss)` "
            "(tf.keras 2: `get_scaled_loss`, then `get_unscaled_gradients`; "
            "JAX: inside a `keras.StatelessScope` mapping the optimizer's "
            "variables to the step's `optimizer_variables`). "
            "If you multiplied the loss by `optimizer.loss_scale` yourself, "
            "ignore this warning.",
            stacklevel=3,
        )

    def _warn_unscaled_in_a_train_step(self, method):
        """Warns, once, of a `fit` step whose loss never reached `scale_loss`.

        Its gradients are applied as they are (unscaled by 1, checked, a
        non-finite step skipped): the model trains, but float16 gradients
        below float16's smallest value were lost before they got here.
        """
        if self._warned_unscaled_loss:
            return
        self._warned_unscaled_loss = True
        line = f"loss = self.{self._keras_mp_label}.scale_loss(loss)"
        warnings.warn(
            f"keras_mp: LossScaleOptimizer.{method} of `self.{self._keras_mp_label}` "
            f"was called in a train_step whose loss was never scaled: its "
            f"gradients are applied as they are (checked, and a step whose "
            f"gradients are not finite is skipped), without loss scaling, so "
            f"float16 gradients below ~6e-8 are lost (underflow). Scale the "
            f"loss before taking its gradients: `{line}`"
            + (
                " (JAX: inside a `keras.StatelessScope` mapping the optimizer's "
                "variables to the step's `optimizer_variables`)."
                if backends.current.STATELESS
                else "."
            ),
            stacklevel=4,
        )

    def _warn_if_the_scale_was_a_constant(self, optimizer_variables):
        """JAX: warns, once, of a compiled step that scaled its loss by a constant.

        Under `jax.jit` the optimizer's state comes in as traced values
        (`optimizer_variables`); a loss scaled outside a StatelessScope that
        maps them was multiplied by `loss_scale` as it was when the step was
        traced, and keeps that factor while the step divides by the current
        scale: after a back-off every step overflows again.
        """
        if self._scale_is_the_steps or self._warned_constant_scale:
            return
        if not backends.current.is_traced(optimizer_variables[self._state_start]):
            return
        self._warned_constant_scale = True
        warnings.warn(
            "LossScaleOptimizer.scale_loss read the loss scale outside the "
            "compiled step's state: the loss is multiplied by the scale it "
            "had when the step was traced, for good. "
            + backends.current.SCALE_IN_A_STATELESS_SCOPE,
            stacklevel=3,
        )

    def check_finite(self, grads):
        """Boolean scalar tensor: whether all gradients are finite."""
        return backends.current.all_finite(grads)

    # -- loss scaling and the tf.keras 2 names ----------------------------------

    def scale_loss(self, loss):
        """Multiplies the loss by the current loss scale.

        Args:
            loss: the loss tensor.

        Returns:
            `loss * loss_scale`, in float32 (or wider, if `loss` is wider).
        """
        self._loss_ever_scaled = True
        if self._scaled_this_step is not None:
            self._scaled_this_step = True
        scale, self._scale_is_the_steps = backends.current.read_scale(self.loss_scale)
        return ops.multiply(loss, scale)

    def get_scaled_loss(self, loss):
        """tf.keras 2 name of `scale_loss`; also takes a callable loss."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """tf.keras 2: divides gradients by the loss scale, in float32.

        The next `apply` / `apply_gradients` then takes its gradients as
        already unscaled (it still checks them and updates the scale), so the
        tf.keras 2 custom loop works unchanged (TensorFlow and PyTorch).

        Returns:
            Unscaled gradients, each in its original dtype.
        """
        if not self._loss_ever_scaled:
            # "Ever", as for `apply`: a loss scaled in a `tf.function` is
            # scaled in Python only when that function is traced.
            warnings.warn(
                "LossScaleOptimizer.get_unscaled_gradients was called, but "
                "the loss was never scaled: take the gradients of "
                "`optimizer.get_scaled_loss(loss)` (or `scale_loss`). "
                "Otherwise the gradients are divided by the loss scale "
                "without having been multiplied by it, and the steps are too "
                "small by that factor.",
                stacklevel=2,
            )
        unscaled = backends.current.unscale(list(grads), self.loss_scale.value, keep_dtype=True)
        self._grads_unscaled_by_caller = True
        return unscaled

    # -- serialization ----------------------------------------------------------

    def get_config(self):
        # Not `super().get_config()`: the base arguments belong to the inner
        # optimizer.
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **dataclasses.asdict(self._config),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "master_weights": self._master_weights,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if config.get("dynamic") is False and config.get("dynamic_growth_steps") == 2000:
            # Written by keras_mp 0.1 for a fixed scale (now `None`).
            config["dynamic_growth_steps"] = None
        inner_optimizer = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)
