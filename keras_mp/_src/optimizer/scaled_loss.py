"""`LossScaleOptimizer.scale_loss`: the loss times the scale, and a loss
that is not finite made to skip its step.

A regression head that overflows predicts `inf`; its MAE is `inf` while
MAE's gradient, the sign of the error, stays finite, so a check of the
gradients alone would apply the step. Keras's train step (every backend)
and custom loops scale the loss before taking its gradients, so the scale
carries a factor that is 1 where the loss is finite and NaN where it is
not, without a gradient of its own: such a loss makes every gradient NaN,
and the step is skipped and counted as one whose gradients overflow. A
finite loss is multiplied by exactly its scale, as before.
"""

from keras import ops

from keras_mp._src import backends
from keras_mp._src.optimizer import unscaled_loss


class ScaleLoss:
    """Mixed into `LossScaleOptimizer`."""

    def scale_loss(self, loss):
        """Multiplies the loss by the current loss scale.

        A loss that is not finite gives NaN gradients, so that its step is
        skipped and counted (a fixed scale with `skip_on_overflow=False`,
        which checks no step, scales it as it is).

        Args:
            loss: the loss tensor.

        Returns:
            `loss * loss_scale`, in float32 (or wider, if `loss` is wider).
        """
        self._loss_ever_scaled = True
        if self._scaled_this_step is not None:
            self._scaled_this_step = True
        unscaled_loss.note_scaled(self)
        scale, self._scale_is_the_steps = backends.current.read_scale(self.loss_scale)
        if self._config.checks_finite:
            # The scale where the loss is finite, NaN where it is not (no
            # gradient flows through `isfinite`): one select, no product.
            scale = ops.where(ops.isfinite(loss), scale, float("nan"))
        return ops.multiply(loss, scale)
