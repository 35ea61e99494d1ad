"""A GAN with two optimizers and a training step of its own, in half precision.

    KERAS_BACKEND=tensorflow python examples/gan.py
    KERAS_BACKEND=torch python examples/gan.py
    KERAS_BACKEND=jax python examples/gan.py

TensorFlow and PyTorch: keras-io's DCGAN, as the guides write it (its own
`compile(d_optimizer, g_optimizer, loss_fn)` and `train_step`), on
scikit-learn's 8x8 digits. `keras_mp.apply_amp` sets the precision; before
the first `fit`, keras_mp wraps each optimizer in what the level needs (a
loss scale in float16, float32 master weights at O3, the skip of a
non-finite step everywhere) and says so. The one line a `train_step` of
your own adds: `self.d_optimizer.scale_loss(d_loss)` before the gradients.

JAX: `fit` carries one optimizer's state, so the GAN is a loop of its own
under `jax.jit`, with two LossScaleOptimizers' `stateless_apply`.

Each level prints both losses, each optimizer's loss scale and skipped
steps, and how far each network's weights moved.
"""

import argparse

LEVELS = (("O2", "float16"), ("O3", "bfloat16"))
LATENT = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs per level (default: 3)")
    parser.add_argument(
        "--steps", type=int, default=None, help="batches of 64 per epoch (default: all digits)"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)  # before Keras loads: `--help` is instant

    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    import keras_mp

    x = (load_digits().images / 16.0).astype("float32")[..., None]
    if args.steps is not None:
        x = x[: 64 * args.steps]
    backend = keras.backend.backend()
    print(f"keras_mp GAN example: {len(x)} digits, backend {backend}, {args.epochs} epochs\n")
    for level, dtype in LEVELS:
        print(f"== {level} {dtype}")
        keras.utils.set_random_seed(0)
        discriminator, generator = _discriminator(keras), _generator(keras)
        before = [_values(keras, m) for m in (discriminator, generator)]
        if backend == "jax":
            logs = _train_with_a_jax_loop(
                keras, keras_mp, discriminator, generator, x, level, dtype, args.epochs
            )
        else:
            gan = _gan_class(keras, backend)(discriminator, generator)
            keras_mp.apply_amp(gan, level, dtype)
            gan.compile(
                d_optimizer=keras.optimizers.Adam(3e-3),
                g_optimizer=keras.optimizers.Adam(3e-3),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
            )
            history = gan.fit(x, epochs=args.epochs, batch_size=64, verbose=0)
            logs = {k: v[-1] for k, v in history.history.items()}
        after = [_values(keras, m) for m in (discriminator, generator)]
        moved = [
            float(np.mean([np.abs(a - b).mean() for a, b in zip(old, new)]))
            for old, new in zip(before, after)
        ]
        print(
            f"  d_loss {logs['d_loss']:.4f}  g_loss {logs['g_loss']:.4f}\n"
            f"  d_optimizer: loss scale {logs['d_optimizer_loss_scale']:g}, "
            f"{logs['d_optimizer_skipped_steps']:.0f} skipped steps\n"
            f"  g_optimizer: loss scale {logs['g_optimizer_loss_scale']:g}, "
            f"{logs['g_optimizer_skipped_steps']:.0f} skipped steps\n"
            f"  mean change of a weight: discriminator {moved[0]:.2e}, generator {moved[1]:.2e}\n"
        )


def _discriminator(keras):
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )


def _generator(keras):
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((LATENT,)),
            layers.Dense(4 * 4 * 16),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((4, 4, 16)),
            layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


def _values(keras, model):
    import numpy as np

    return [np.asarray(keras.ops.convert_to_numpy(v), "float32") for v in model.weights]


def _gan_class(keras, backend):
    """keras-io's GAN, with `scale_loss` before each network's gradients."""

    class GAN(keras.Model):
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.seed_generator = keras.random.SeedGenerator(1337)
            self.built = True

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def batch(self, real_images):
            batch_size = keras.ops.shape(real_images)[0]
            noise = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
            fake = self.generator(noise)
            images = keras.ops.concatenate([fake, real_images], axis=0)
            labels = keras.ops.concatenate(
                [keras.ops.ones((batch_size, 1)), keras.ops.zeros((batch_size, 1))], axis=0
            )
            labels += 0.05 * keras.random.uniform(keras.ops.shape(labels), seed=self.seed_generator)
            noise = keras.random.normal((batch_size, LATENT), seed=self.seed_generator)
            return images, labels, noise, keras.ops.zeros((batch_size, 1))

    if backend == "tensorflow":
        import tensorflow as tf

        class TensorFlowGAN(GAN):
            def train_step(self, real_images):
                images, labels, noise, misleading = self.batch(real_images)
                with tf.GradientTape() as tape:
                    d_loss = self.loss_fn(labels, self.discriminator(images))
                    scaled = self.d_optimizer.scale_loss(d_loss)  # the one line
                grads = tape.gradient(scaled, self.discriminator.trainable_weights)
                self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
                with tf.GradientTape() as tape:
                    g_loss = self.loss_fn(misleading, self.discriminator(self.generator(noise)))
                    scaled = self.g_optimizer.scale_loss(g_loss)  # the one line
                grads = tape.gradient(scaled, self.generator.trainable_weights)
                self.g_optimizer.apply(grads, self.generator.trainable_weights)
                return {"d_loss": d_loss, "g_loss": g_loss}

        return TensorFlowGAN

    import torch

    class TorchGAN(GAN):
        def train_step(self, real_images):
            images, labels, noise, misleading = self.batch(real_images)
            self.zero_grad()
            d_loss = self.loss_fn(labels, self.discriminator(images))
            self.d_optimizer.scale_loss(d_loss).backward()  # the one line
            grads = [v.value.grad for v in self.discriminator.trainable_weights]
            with torch.no_grad():
                self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
            self.zero_grad()
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(noise)))
            self.g_optimizer.scale_loss(g_loss).backward()  # the one line
            grads = [v.value.grad for v in self.generator.trainable_weights]
            with torch.no_grad():
                self.g_optimizer.apply(grads, self.generator.trainable_weights)
            return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}

    return TorchGAN


def _train_with_a_jax_loop(keras, keras_mp, discriminator, generator, x, level, dtype, epochs):
    """The same GAN as a jitted loop: each network's step is a function of
    values, and each optimizer's `stateless_apply` skips its own non-finite
    steps. The loss is scaled inside a StatelessScope that maps the
    optimizer's variables to the step's values, as Keras's own step does."""
    import jax
    import numpy as np

    for network in (discriminator, generator):
        keras_mp.apply_amp(network, level, dtype)
    float16 = dtype == "float16"
    optimizers = {}
    for name, network in (("d", discriminator), ("g", generator)):
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(3e-3),
            dynamic=float16,  # a loss scale in float16; a checked 1 in bfloat16
            initial_scale=2.0**15 if float16 else 1.0,
            name=f"{name}_optimizer",
        )
        optimizer.build(network.trainable_variables)
        optimizers[name] = optimizer
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def values(variables):
        return [v.value for v in variables]

    def scaled(optimizer, optimizer_values, loss):
        with keras.StatelessScope(state_mapping=zip(optimizer.variables, optimizer_values)):
            return optimizer.scale_loss(loss)

    def d_loss_fn(d_trainable, d_rest, g_state, d_opt, real, noise, labels):
        fake, _ = generator.stateless_call(*g_state, noise)
        images = jax.numpy.concatenate([fake, real], axis=0)
        predictions, d_rest = discriminator.stateless_call(d_trainable, d_rest, images)
        loss = loss_fn(labels, predictions)
        return scaled(optimizers["d"], d_opt, loss), (loss, d_rest)

    def g_loss_fn(g_trainable, g_rest, d_state, g_opt, noise):
        fake, g_rest = generator.stateless_call(g_trainable, g_rest, noise)
        predictions, _ = discriminator.stateless_call(*d_state, fake)
        loss = loss_fn(jax.numpy.zeros((noise.shape[0], 1)), predictions)
        return scaled(optimizers["g"], g_opt, loss), (loss, g_rest)

    @jax.jit
    def step(state, real, key):
        d_tr, d_rest, d_opt, g_tr, g_rest, g_opt = state
        first, second, third = jax.random.split(key, 3)
        batch = real.shape[0]
        labels = jax.numpy.concatenate([jax.numpy.ones((batch, 1)), jax.numpy.zeros((batch, 1))])
        labels = labels + 0.05 * jax.random.uniform(third, labels.shape)
        noise = jax.random.normal(first, (batch, LATENT))
        grads, (d_loss, d_rest) = jax.grad(d_loss_fn, has_aux=True)(
            d_tr, d_rest, (g_tr, g_rest), d_opt, real, noise, labels
        )
        d_tr, d_opt = optimizers["d"].stateless_apply(d_opt, grads, d_tr)
        noise = jax.random.normal(second, (batch, LATENT))
        grads, (g_loss, g_rest) = jax.grad(g_loss_fn, has_aux=True)(
            g_tr, g_rest, (d_tr, d_rest), g_opt, noise
        )
        g_tr, g_opt = optimizers["g"].stateless_apply(g_opt, grads, g_tr)
        return (d_tr, d_rest, d_opt, g_tr, g_rest, g_opt), d_loss, g_loss

    state = (
        values(discriminator.trainable_variables),
        values(discriminator.non_trainable_variables),
        values(optimizers["d"].variables),
        values(generator.trainable_variables),
        values(generator.non_trainable_variables),
        values(optimizers["g"].variables),
    )
    key = jax.random.PRNGKey(0)
    for _ in range(epochs):
        for start in range(0, len(x) - 63, 64):
            key, subkey = jax.random.split(key)
            state, d_loss, g_loss = step(state, x[start : start + 64], subkey)
    d_tr, d_rest, d_opt, g_tr, g_rest, g_opt = state
    for variables, new in (
        (discriminator.trainable_variables, d_tr),
        (discriminator.non_trainable_variables, d_rest),
        (optimizers["d"].variables, d_opt),
        (generator.trainable_variables, g_tr),
        (generator.non_trainable_variables, g_rest),
        (optimizers["g"].variables, g_opt),
    ):
        for variable, value in zip(variables, new):
            variable.assign(value)
    logs = {"d_loss": float(d_loss), "g_loss": float(g_loss)}
    for name, optimizer in optimizers.items():
        logs[f"{name}_optimizer_loss_scale"] = float(np.asarray(optimizer.loss_scale))
        logs[f"{name}_optimizer_skipped_steps"] = float(np.asarray(optimizer.skipped_steps))
    return logs


if __name__ == "__main__":
    main()
