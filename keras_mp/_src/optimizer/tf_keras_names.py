"""The names tf.keras 2 and Keras's built-in `LossScaleOptimizer` gave things.

Code written for them runs unchanged on keras_mp's `LossScaleOptimizer`:
`get_scaled_loss` / `get_unscaled_gradients` (tf.keras 2's custom loop),
`dynamic_scale` / `step_counter` (Keras 3's built-in) and `dynamic_counter`
(tf.keras 2; None for a fixed scale, which counts nothing towards growth).
"""

import warnings

from keras_mp._src import backends


class TfKeras2Names:
    """Mixed into `LossScaleOptimizer`, whose state variables they name."""

    dynamic_scale = property(lambda self: self.loss_scale)
    step_counter = property(lambda self: self.good_steps)
    # tf.keras 2: None for a fixed scale, which counts nothing towards growth.
    dynamic_counter = property(lambda self: self.good_steps if self._config.dynamic else None)

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
