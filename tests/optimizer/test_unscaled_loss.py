"""Warnings of a loss that never reached `scale_loss`, once per optimizer."""

import warnings

import keras
import pytest

import keras_mp
from tests.loops import check_loop_result
from tests.loops import loop_data
from tests.loops import loop_model
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND

pytestmark = SCALED_BY_HAND


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit loop")
@pytest.mark.parametrize("scope", [True, False], ids=["stateless_scope", "no_scope"])
def test_jitted_jax_loop_scales_by_the_steps_own_scale(scope):
    """Under `jax.jit` the scale must come from the step's optimizer values
    (a StatelessScope, as Keras's JAX step and the README's example do); read
    from the variable it is a constant of the trace, which keras_mp says."""
    import jax

    x, y = loop_data()
    model = loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
    optimizer.build(model.trainable_variables)

    def loss_fn(trainable, optimizer_values):
        pred, _ = model.stateless_call(trainable, [], x)
        loss = jax.numpy.mean(jax.numpy.square(pred - y))
        if not scope:
            return optimizer.scale_loss(loss)
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_values))):
            return optimizer.scale_loss(loss)

    @jax.jit
    def train_step(trainable, optimizer_values):
        grads = jax.grad(loss_fn)(trainable, optimizer_values)
        return optimizer.stateless_apply(optimizer_values, grads, trainable)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainable, _ = train_step(
            [v.value for v in model.trainable_variables], [v.value for v in optimizer.variables]
        )
    told = [str(w.message) for w in caught if "StatelessScope" in str(w.message)]
    assert len(told) == (0 if scope else 1)
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    check_loop_result(model, x, y)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's fit")
def test_jax_train_step_scaling_outside_its_state_is_told_how():
    """Inside JAX's `fit` the optimizer's variables hold no value (the step
    carries the state): `scale_loss` outside a StatelessScope says how to
    scale, instead of Keras's "'NoneType' object is not callable"."""
    import jax

    class Unmapped(keras.Model):
        def train_step(self, state, data):
            trainables, non_trainables, optimizer_variables, metrics_variables = state
            x, y = data

            def loss_fn(trainables):
                y_pred, _ = self.stateless_call(trainables, non_trainables, x, training=True)
                return self.optimizer.scale_loss(self.compute_loss(x, y, y_pred))

            grads = jax.grad(loss_fn)(trainables)
            trainables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainables
            )
            return {}, (trainables, non_trainables, optimizer_variables, metrics_variables)

    x, y = loop_data()
    inputs = keras.Input((3,))
    model = Unmapped(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", amp_level="O2")
    with pytest.raises(ValueError, match=r"(?s)inside `fit`.*keras.StatelessScope\(state_mapping"):
        model.fit(x, y, verbose=0)


def _gradients_of_a_raw_loop(model, optimizer, x, y, scaled):
    """One step of a loop of the user's own, as each backend's users write
    it: the gradients of the MSE, scaled with `scale_loss` or not."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            loss = optimizer.scale_loss(loss) if scaled else loss
        return tape.gradient(loss, model.trainable_variables)
    if BACKEND == "torch":
        import torch

        model.zero_grad()
        loss = torch.mean(torch.square(model(x) - keras.ops.convert_to_tensor(y)))
        (optimizer.scale_loss(loss) if scaled else loss).backward()
        return [v.value.grad for v in model.trainable_variables]
    import jax

    def loss_fn(trainable):
        pred, _ = model.stateless_call(trainable, [], x)
        loss = jax.numpy.mean(jax.numpy.square(pred - y))
        return optimizer.scale_loss(loss) if scaled else loss

    return jax.grad(loss_fn)([v.value for v in model.trainable_variables])


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize(
    "scale, after_fit",
    [("dynamic", False), ("fixed", False), ("dynamic", True)],
    ids=["dynamic", "fixed", "dynamic_after_fit"],
)
def test_a_raw_loop_whose_loss_was_never_scaled_is_told_once(scale, after_fit, scaled):
    """`optimizer.apply` in a loop of the user's own, in float16, whose loss
    never reached `scale_loss`: warned once, naming the optimizer and the
    line to add; a loop that scales its loss is not. After a `fit` (whose
    step scaled the loss) the loop that does not scale is told too: it was
    not, since `fit`'s scaling counted for it."""
    x, y = loop_data()
    model = loop_model()
    keras_mp.apply_amp(model, "O2")
    arguments = {"dynamic": False, "initial_scale": 1024.0} if scale == "fixed" else {}
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01), name="lso", **arguments)
    if after_fit:
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            grads = _gradients_of_a_raw_loop(model, optimizer, x, y, scaled)
            optimizer.apply(grads, model.trainable_variables)
    told = [str(w.message) for w in caught if "loss was never scaled" in str(w.message)]
    if scaled:
        assert told == []
        return
    assert len(told) == 1, told
    assert "`lso` (wrapping SGD)" in told[0]
    assert "`loss = optimizer.scale_loss(loss)`" in told[0]
    assert ("outside `fit`" in told[0]) == after_fit
