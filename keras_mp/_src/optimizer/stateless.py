"""`LossScaleOptimizer.stateless_apply`: the step as a function of values.

Keras's JAX trainer runs the optimizer statelessly under `jax.jit`; so does
a custom JAX loop (`examples/custom_training_loop.py`). The step's decision
to skip stays on the device (`backends/jax.py`).
"""

import functools

from keras_mp._src import backends
from keras_mp._src.optimizer import skipped_state
from keras_mp._src.optimizer import unscaled_loss
from keras_mp._src.optimizer.inner_optimizer import stateless_apply_kept_if


class StatelessApply:
    """Mixed into `LossScaleOptimizer`."""

    def stateless_apply(
        self, optimizer_variables, grads, trainable_variables, non_trainable_variables=None
    ):
        """Stateless step: returns new trainable and optimizer variable values.

        With `non_trainable_variables=(before, after)` (the non-trainable
        values given to the forward pass and those it returned, such as
        BatchNorm's moving statistics), it also returns the non-trainable
        values to carry on with: `before` where the step was skipped,
        `after` otherwise (`skipped_state.py`). A custom loop's NaN batch
        then leaves them as they were, as `fit` does.

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
        unscaled_loss.warn_if_the_loss_was_never_scaled(self, "stateless_apply")
        unscaled_loss.warn_if_the_scale_was_a_constant(self, optimizer_variables)
        if non_trainable_variables is not None:
            skipped_state.check_pair(non_trainable_variables)
        step = self._step(self._trainable_variables)
        new_trainable, new_optimizer = backends.current.run_stateless(
            functools.partial(backends.current.stateless_step, step),
            self._stateless_cache,
            optimizer_variables,
            grads,
            list(trainable_variables),
        )
        if non_trainable_variables is None:
            return new_trainable, new_optimizer
        kept = skipped_state.kept_if_skipped(
            self._state_start + 2, optimizer_variables, new_optimizer, non_trainable_variables
        )
        return new_trainable, new_optimizer, kept

    def _inner_stateless_apply(self, own_values, inner_values, grads, trainable_values, kept=None):
        """`(new_trainable, new_own, new_inner)` values of an applied step.

        With `kept` (a boolean scalar), the inner optimizer's assignments
        and the master copies are kept only where it is True
        (`stateless_apply_kept_if`): every value but the loss-scale state's
        is then already the chosen one.
        """
        inner_apply = self.inner_optimizer.stateless_apply
        if kept is not None:
            inner_apply = functools.partial(stateless_apply_kept_if, self.inner_optimizer, kept)
        if self._masters is None:
            new_trainable, new_inner = inner_apply(inner_values, grads, trainable_values)
            return list(new_trainable), list(own_values), list(new_inner)
        return self._masters.stateless_apply(
            inner_apply, own_values, inner_values, grads, trainable_values, kept=kept
        )
