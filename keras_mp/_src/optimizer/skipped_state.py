"""State a skipped step keeps besides the weights, in a loop of the user's own.

A forward pass with `training=True` changes non-trainable state before any
gradient exists: BatchNorm's moving mean and variance take the batch's
statistics, so a NaN batch makes them NaN although its step is then
skipped, and every later `predict` is NaN. Under `fit` the train step puts
them back (`train_step.py`); in a custom loop the loop says which state is
the step's:

- TensorFlow, PyTorch (and JAX's eager `apply`): the step inside
  `with optimizer.restore_on_skip(model):` (`RestoreOnSkip`); the values are
  read on entry and put back on exit where the optimizer skipped.
- JAX under `jax.jit`: `stateless_apply(..., non_trainable_variables=(before,
  after))` returns `before` for a skipped step, `after` otherwise
  (`kept_if_skipped`).

Both decide from the optimizer's own `skipped_steps` (did it move?) with a
select per value: nothing is brought to the host. Every replica (a
`tf.distribute` strategy, `jax.sharding`, PyTorch's DistributedDataParallel)
takes the optimizer's one decision, so they stay in step.
"""

import keras
from keras import ops


def _variables_of(target):
    if isinstance(target, keras.Layer):
        return list(target.non_trainable_variables)
    iterable = isinstance(target, (list, tuple))
    variables = list(target) if iterable else []
    if not iterable or not all(isinstance(v, keras.Variable) for v in variables):
        raise TypeError(
            "`restore_on_skip` takes a model (or layer), whose non-trainable "
            "variables it keeps, or a list of Keras variables. Received: "
            f"{type(target).__name__}"
        )
    return variables


class RestoreOnSkip:
    """`with optimizer.restore_on_skip(model):` around a step of a custom loop.

    On entry, the non-trainable variables (BatchNorm's moving statistics,
    a seed generator's state) are read; on exit, each is put back where the
    optimizer's steps inside the block were skipped. Traced in a
    `tf.function`, run eagerly, or on PyTorch alike.
    """

    def __init__(self, optimizer, target):
        self.optimizer = optimizer
        self.variables = _variables_of(target)
        self._kept = None

    def __enter__(self):
        # Copies: on PyTorch `.value` is the parameter itself, updated in place.
        self._kept = [ops.copy(v.value) for v in self.variables]
        self._skipped_before = ops.copy(self.optimizer.skipped_steps.value)
        return self

    def __exit__(self, kind, error, traceback):
        kept, self._kept = self._kept, None
        if kind is not None:
            return False
        skipped = ops.not_equal(self.optimizer.skipped_steps.value, self._skipped_before)
        for variable, old in zip(self.variables, kept):
            variable.assign(ops.where(skipped, old, variable.value))
        return False


def check_pair(pair):
    """`non_trainable_variables=(before, after)`: two lists of one length."""
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(isinstance(p, (tuple, list)) for p in pair)
        or len(pair[0]) != len(pair[1])
    ):
        raise ValueError(
            "`non_trainable_variables` must be a pair `(before, after)`: the "
            "non-trainable values given to the forward pass, and those it "
            "returned (`model.stateless_call(..., training=True)`), two lists "
            f"of one length. Received: non_trainable_variables={_shape_of(pair)}"
        )
    return list(pair[0]), list(pair[1])


def _shape_of(pair):
    if isinstance(pair, (tuple, list)):
        inner = ", ".join(
            f"list of {len(p)}" if isinstance(p, (tuple, list)) else type(p).__name__ for p in pair
        )
        return f"{type(pair).__name__} of {len(pair)} ({inner})"
    return type(pair).__name__


def kept_if_skipped(skipped_index, optimizer_before, optimizer_after, pair):
    """`before` where the step was skipped (its `skipped_steps` moved), else
    `after`: one select per value."""
    before, after = check_pair(pair)
    skipped = ops.not_equal(optimizer_after[skipped_index], optimizer_before[skipped_index])
    return [ops.where(skipped, old, new) for old, new in zip(before, after)]


class RestoreOnSkipMethod:
    """Mixed into `LossScaleOptimizer`."""

    def restore_on_skip(self, model):
        """A context manager: a step skipped inside it keeps `model`'s state.

        A forward pass with `training=True` updates BatchNorm's moving
        statistics before any gradient exists; wrap the custom loop's step
        (forward pass, gradients, `apply`) in it, and a skipped step leaves
        them (every non-trainable variable of `model`) as they were:

        ```python
        with optimizer.restore_on_skip(model):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled_loss = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled_loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
        ```

        Args:
            model: a model or layer (its `non_trainable_variables`), or a
                list of Keras variables.

        JAX under `jax.jit`: `stateless_apply(..., non_trainable_variables=
        (before, after))` instead.
        """
        return RestoreOnSkip(self, model)
