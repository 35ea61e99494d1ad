"""Warnings of a loss that never reached `scale_loss`, said once per optimizer.

Custom training code written without loss scaling in mind (Keras's
"customizing fit" guides, a loop of one's own) applies gradients of an
unscaled loss; a compiled JAX step may scale by a constant. Each is known in
Python, when the step is traced or run: the checks cost the step nothing.
`self` is the `LossScaleOptimizer`.
"""

import warnings

from keras_mp._src import backends


def note_scaled(self):
    """`scale_loss` ran: outside a `fit` step, the user's loop scales its loss."""
    if self._scaled_this_step is None:
        self._loss_scaled_outside_fit = True


def warn_if_the_loss_was_never_scaled(self, method):
    """Warns, once, of gradients applied while `scale_loss` never ran.

    Keras's own `train_step` scales the loss; a custom `train_step` or
    loop written without loss scaling in mind (Keras's "customizing
    fit" guide, a `GradientTape` / `loss.backward()` / `jax.grad` loop
    that then calls `optimizer.apply`) does not, and its gradients,
    divided by a scale they were never multiplied by, make every update
    `loss_scale` times too small: the model does not train, and nothing
    says why. Inside `fit` the train step tells, step by step
    (`_scaled_this_step`). Outside it, in a loop of the user's own, the
    warning comes when `scale_loss` never ran outside `fit`: an optimizer
    that trained under `fit` (whose step scaled the loss) and then in a
    loop that does not is told too. Known in Python (when the step is
    traced or run), so the check costs no step anything. Not "since the
    last step": a loss scaled in one `tf.function` (or `jax.jit`) and
    applied outside it is scaled in Python only when that is traced.
    """
    if self._unit_scale:
        return  # dividing by 1 changes nothing
    if self._scaled_this_step is False:
        _warn_unscaled_in_a_train_step(self, method)
        return
    if self._scaled_this_step or self._loss_scaled_outside_fit or self._warned_unscaled_loss:
        return
    self._warned_unscaled_loss = True
    where = " outside `fit`" if self._loss_ever_scaled else ""
    warnings.warn(
        f"LossScaleOptimizer.{method} was called, but the loss was never "
        f"scaled{where}: `{self.name}` (wrapping "
        f"{type(self.inner_optimizer).__name__}) divides its gradients by the "
        f"loss scale ({self.initial_scale:g} at the start) though they were "
        "never multiplied by it, so every update is that many times too "
        "small and the model hardly trains. Scale the loss before taking "
        "its gradients, as Keras's own `train_step` does: add "
        "`loss = optimizer.scale_loss(loss)` with this optimizer "
        "(`self.optimizer.scale_loss(loss)` in a `train_step`; tf.keras 2: "
        "`get_scaled_loss`, then `get_unscaled_gradients`; JAX: inside a "
        "`keras.StatelessScope` mapping the optimizer's variables to the "
        "step's `optimizer_variables`). If you multiplied the loss by "
        "`optimizer.loss_scale` yourself, ignore this warning.",
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
    # Where the model holds it (`wrapping.name_in_logs`): `self.d_optimizer`,
    # or `self.optimizer` in a layer's own code.
    code = getattr(self, "_keras_mp_code", f"self.{self._keras_mp_label}")
    holder = getattr(self, "_keras_mp_holder", "")
    line = f"loss = {code}.scale_loss(loss)"
    warnings.warn(
        f"keras_mp: LossScaleOptimizer.{method} of `{code}`{holder} "
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


def warn_if_the_scale_was_a_constant(self, optimizer_variables):
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
        "had when the step was traced, for good. " + backends.current.SCALE_IN_A_STATELESS_SCOPE,
        stacklevel=3,
    )
