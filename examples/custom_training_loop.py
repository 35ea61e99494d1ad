"""A custom training loop with loss scaling, on the backend you run it with.

    KERAS_BACKEND=tensorflow python examples/custom_training_loop.py
    KERAS_BACKEND=jax python examples/custom_training_loop.py
    KERAS_BACKEND=torch python examples/custom_training_loop.py

Each backend's `train_step` below is the one the README shows (the tests
check that they are the same text); `run_step` drives it. The model
computes in float16 with float32 weights (O2); one batch holds a NaN: its
step is skipped, the weights and BatchNorm's moving statistics stay as
they were, and the scale is halved.
"""

# -- the README's set-up --------------------------------------------------------
import keras
import numpy as np

import keras_mp

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [
        keras.Input((20,)),
        keras.layers.Dense(64),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Dense(10),
    ]
)
keras_mp.apply_amp(model, "O2")  # float16 compute, float32 weights
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
optimizer.build(model.trainable_variables)
# -------------------------------------------------------------------------------

BACKEND = keras.backend.backend()

if BACKEND == "tensorflow":
    import tensorflow as tf

    @tf.function
    def train_step(x, y):
        with optimizer.restore_on_skip(model):  # a skipped step keeps BatchNorm's statistics
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled_loss = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled_loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)  # unscales, checks, skips
        return loss


if BACKEND == "jax":
    import jax

    def compute_loss(trainable, non_trainable, optimizer_values, x, y):
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        loss = loss_fn(y, y_pred)
        # The scale is one of the optimizer's values, as in `fit`.
        mapping = zip(optimizer.variables, optimizer_values)
        with keras.StatelessScope(state_mapping=mapping):
            scaled_loss = optimizer.scale_loss(loss)
        return scaled_loss, (loss, non_trainable)

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_values = state
        grads, (loss, new_non_trainable) = jax.grad(compute_loss, has_aux=True)(
            trainable, non_trainable, optimizer_values, x, y
        )
        # Unscales, checks, skips; a skipped step keeps BatchNorm's statistics.
        trainable, optimizer_values, non_trainable = optimizer.stateless_apply(
            optimizer_values,
            grads,
            trainable,
            non_trainable_variables=(non_trainable, new_non_trainable),
        )
        return loss, (trainable, non_trainable, optimizer_values)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )

    def run_step(x, y):
        global state
        loss, state = train_step(state, x, y)
        return loss

    def sync_state():
        """The loop's state, back into the model and the optimizer."""
        values = state
        variables = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
        for group, group_values in zip(variables, values):
            for variable, value in zip(group, group_values):
                variable.assign(value)


if BACKEND == "torch":

    def train_step(x, y):
        with optimizer.restore_on_skip(model):  # a skipped step keeps BatchNorm's statistics
            loss = loss_fn(y, model(x, training=True))
            model.zero_grad()
            optimizer.scale_loss(loss).backward()
            grads = [v.value.grad for v in model.trainable_variables]
            optimizer.apply(grads, model.trainable_variables)  # unscales, checks, skips
        return loss


if BACKEND != "jax":
    run_step = train_step


def main(steps=60, bad_step=30):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 20)).astype("float32")
    losses = []
    for step in range(steps):
        y = rng.integers(0, 10, size=64)
        x = centers[y] + 0.5 * rng.normal(size=(64, 20)).astype("float32")
        if step == bad_step:
            x[0, 0] = np.nan  # a corrupt batch: this step is skipped
        losses.append(float(keras.ops.convert_to_numpy(run_step(x, y.astype("int32")))))
    if BACKEND == "jax":
        sync_state()
    scale = float(keras.ops.convert_to_numpy(optimizer.loss_scale))
    skipped = int(keras.ops.convert_to_numpy(optimizer.skipped_steps))
    applied = int(keras.ops.convert_to_numpy(optimizer.iterations))
    print(f"backend: {BACKEND}")
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    statistics = [keras.ops.convert_to_numpy(v) for v in model.non_trainable_variables]
    finite = all(np.isfinite(s).all() for s in statistics)
    print(f"loss scale: {scale:g}, skipped steps: {skipped}, applied steps: {applied}")
    print(f"BatchNorm's moving statistics finite: {finite}")
    return losses, scale, skipped, applied


if __name__ == "__main__":
    main()
