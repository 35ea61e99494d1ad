"""keras-io's examples with a training code of their own, ported as users
copy them and trimmed to seconds (8x8 digits, a few filters), with their
own `compile` signatures and `train_step`s as written.

- `Distiller`: `examples/vision/knowledge_distillation.py` (Keras 3): its own
  `compile(optimizer, metrics, student_loss_fn, distillation_loss_fn,
  alpha, temperature)` and an overridden `compute_loss`; every backend.
- `TensorFlowGAN`: `examples/generative/dcgan_overriding_train_step.py`:
  `compile(d_optimizer, g_optimizer, loss_fn)` and a `train_step` with two
  `tf.GradientTape`s.
- `TorchGAN`: the GAN of Keras's guide "Customizing what happens in `fit()`
  with PyTorch", the same model with `backward()`.
- `VAE` and `Sampling`: `examples/generative/vae.py`: a `train_step` of its
  own, and a layer that adds a float32 `keras.random.normal` draw to its
  half inputs.

`scaled=True` adds the one line README documents for a `train_step` of
one's own in float16: the loss through `scale_loss` before its gradients.
"""

import functools

import keras
import numpy as np
from keras import layers
from keras import ops

LATENT = 8


@functools.lru_cache(maxsize=None)
def digits(rows=256):
    """scikit-learn's 8x8 digits in [0, 1] with a channel, and their labels."""
    from sklearn import datasets

    data = datasets.load_digits()
    x = (data.images[:rows] / 16.0).astype("float32")[..., None]
    return x, data.target[:rows].astype("int32")


# -- knowledge distillation -------------------------------------------------


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def classifier(width, name):
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(width, 3, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name=name,
    )


@functools.lru_cache(maxsize=None)
def _trained_teacher_weights():
    """The teacher keras-io trains before it distills (float32), trained
    once a process: each distiller starts from the same teacher."""
    keras.utils.set_random_seed(1)
    x, y = digits()
    teacher = classifier(16, "teacher")
    teacher.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    teacher.fit(x, y, epochs=3, batch_size=64, verbose=0)
    return teacher.get_weights()


def distiller():
    """A Distiller whose teacher has been trained (float32), seeded."""
    teacher_weights = _trained_teacher_weights()
    keras.utils.set_random_seed(1)
    teacher = classifier(16, "teacher")
    teacher.set_weights(teacher_weights)
    return Distiller(student=classifier(8, "student"), teacher=teacher)


def compile_distiller(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )


# -- GANs: two optimizers ---------------------------------------------------


def discriminator():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(8, 3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )


def generator():
    return keras.Sequential(
        [
            keras.Input((LATENT,)),
            layers.Dense(4 * 4 * 8),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((4, 4, 8)),
            layers.Conv2DTranspose(8, 4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class _GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, scaled=False):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.scaled = scaled
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True  # as the guides' GANs (no `call` to build it from)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def scale(self, optimizer, loss):
        """README's one line, where the test asks for it."""
        return optimizer.scale_loss(loss) if self.scaled else loss


class TensorFlowGAN(_GAN):
    def train_step(self, real_images):
        import tensorflow as tf

        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
            scaled = self.scale(self.d_optimizer, d_loss)
        grads = tape.gradient(scaled, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
            scaled = self.scale(self.g_optimizer, g_loss)
        grads = tape.gradient(scaled, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


class TorchGAN(_GAN):
    def train_step(self, real_images):
        import torch

        if isinstance(real_images, (tuple, list)):
            real_images = real_images[0]
        batch_size = real_images.shape[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = torch.concat([generated_images, real_images], axis=0)
        labels = torch.concat([torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)

        self.zero_grad()
        predictions = self.discriminator(combined_images)
        d_loss = self.loss_fn(labels, predictions)
        self.scale(self.d_optimizer, d_loss).backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = torch.zeros((batch_size, 1))
        self.zero_grad()
        predictions = self.discriminator(self.generator(random_latent_vectors))
        g_loss = self.loss_fn(misleading_labels, predictions)
        self.scale(self.g_optimizer, g_loss).backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


def gan(scaled=False):
    """The backend's GAN (TensorFlow's or PyTorch's), seeded; None on JAX,
    whose `fit` carries one optimizer's state (its GAN is a loop:
    `examples/gan.py`)."""
    cls = {"tensorflow": TensorFlowGAN, "torch": TorchGAN}.get(keras.backend.backend())
    if cls is None:
        return None
    keras.utils.set_random_seed(2)
    return cls(discriminator(), generator(), LATENT, scaled=scaled)


def compile_gan(model, d_optimizer=None, g_optimizer=None):
    model.compile(
        d_optimizer=d_optimizer or keras.optimizers.Adam(learning_rate=3e-3),
        g_optimizer=g_optimizer or keras.optimizers.Adam(learning_rate=3e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


# -- the VAE ------------------------------------------------------------------


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, scaled=False, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.scaled = scaled
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker]

    def train_step(self, data):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            scaled = self.optimizer.scale_loss(total_loss) if self.scaled else total_loss
        grads = tape.gradient(scaled, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        return {"loss": self.total_loss_tracker.result()}

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return self.decoder(z)


def vae(scaled=False, latent_dim=2):
    keras.utils.set_random_seed(3)
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu", name="encoder_hidden")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling(name="sampling")([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(4 * 4 * 8, activation="relu")(latent_inputs)
    x = layers.Reshape((4, 4, 8))(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, outputs, name="decoder")
    return VAE(encoder, decoder, scaled=scaled)


def weights_of(layer):
    return [np.array(keras.ops.convert_to_numpy(v.value), dtype="float32") for v in layer.weights]


def moved(before, after):
    """How many of the weights changed at all."""
    return sum(not np.array_equal(a, b) for a, b in zip(before, after))


# -- Forward-Forward: an optimizer in each layer --------------------------------


class FFDense(layers.Layer):
    """keras-io's `examples/vision/forwardforward.py` layer: a Dense that
    trains itself, with its own optimizer, in `forward_forward`."""

    def __init__(self, units, optimizer, loss_metric, num_epochs=5, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units=units)
        self.relu = layers.ReLU()
        self.optimizer = optimizer
        self.loss_metric = loss_metric
        self.threshold = 1.5
        self.num_epochs = num_epochs

    def call(self, x):
        x_norm = ops.norm(x, ord=2, axis=1, keepdims=True)
        x_norm = x_norm + 1e-4
        x_dir = x / x_norm
        res = self.dense(x_dir)
        return self.relu(res)

    def ff_loss(self, x_pos, x_neg):
        g_pos = ops.mean(ops.power(self.call(x_pos), 2), 1)
        g_neg = ops.mean(ops.power(self.call(x_neg), 2), 1)
        loss = ops.log(
            1 + ops.exp(ops.concatenate([-g_pos + self.threshold, g_neg - self.threshold], 0))
        )
        return ops.cast(ops.mean(loss), "float32")

    def forward_forward(self, x_pos, x_neg):
        for _ in range(self.num_epochs):
            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    mean_loss = self.ff_loss(x_pos, x_neg)
                    self.loss_metric.update_state([mean_loss])
                gradients = tape.gradient(mean_loss, self.dense.trainable_weights)
                self.optimizer.apply_gradients(zip(gradients, self.dense.trainable_weights))
            elif keras.backend.backend() == "jax":  # a gradient, then `apply`
                import jax

                def loss_of(values):
                    mapping = zip(self.dense.trainable_weights, values)
                    with keras.StatelessScope(state_mapping=mapping):
                        return self.ff_loss(x_pos, x_neg)

                weights = self.dense.trainable_weights
                mean_loss, gradients = jax.value_and_grad(loss_of)([w.value for w in weights])
                self.loss_metric.update_state([mean_loss])
                self.optimizer.apply(gradients, weights)
            else:  # PyTorch: the same step with `backward()`
                import torch

                for weight in self.dense.trainable_weights:
                    weight.value.grad = None
                mean_loss = self.ff_loss(x_pos, x_neg)
                self.loss_metric.update_state([mean_loss.detach()])
                mean_loss.backward()
                gradients = [w.value.grad for w in self.dense.trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, self.dense.trainable_weights)
        return (
            ops.stop_gradient(self.call(x_pos)),
            ops.stop_gradient(self.call(x_neg)),
            self.loss_metric.result(),
        )


class FFNetwork(keras.Model):
    """keras-io's `FFNetwork`: a `train_step` that trains each `FFDense`
    with its own optimizer; labels overlaid on the first 10 pixels."""

    def __init__(self, dims, **kwargs):
        super().__init__(**kwargs)
        self.loss_var = keras.Variable(0.0, trainable=False, dtype="float32")
        self.loss_count = keras.Variable(0.0, trainable=False, dtype="float32")
        self.layer_list = [keras.Input(shape=(dims[0],))]
        for d in range(len(dims) - 1):
            self.layer_list += [
                FFDense(
                    dims[d + 1],
                    optimizer=keras.optimizers.Adam(learning_rate=0.03),
                    loss_metric=keras.metrics.Mean(),
                )
            ]

    def overlay_y_on_x(self, x, y):
        max_sample = ops.max(x, axis=1, keepdims=True)
        return ops.concatenate([ops.one_hot(y, 10) * max_sample, x[:, 10:]], axis=1)

    def train_step(self, *state_and_data):
        # JAX's `fit` passes (state, data): the step is refused there before
        # it runs (its compiled step carries `model.optimizer`'s state only).
        x, y = state_and_data[-1]
        x = ops.reshape(x, (-1, 64))
        x_pos = self.overlay_y_on_x(x, y)
        random_y = keras.random.shuffle(y, seed=self.seed)
        x_neg = self.overlay_y_on_x(x, random_y)
        h_pos, h_neg = x_pos, x_neg
        for layer in self.layers:
            if isinstance(layer, FFDense):
                h_pos, h_neg, loss = layer.forward_forward(h_pos, h_neg)
                self.loss_var.assign_add(loss)
                self.loss_count.assign_add(1.0)
        return {"FinalLoss": self.loss_var / self.loss_count}

    @functools.cached_property
    def seed(self):
        return keras.random.SeedGenerator(7)


def forward_forward(dims=(64, 16, 16)):
    """keras-io's Forward-Forward network on 8x8 digits, seeded."""
    keras.utils.set_random_seed(4)
    model = FFNetwork(dims=list(dims))
    # Built on a batch, as Keras asks on JAX and PyTorch (no `call` to build from).
    h = np.zeros((1, dims[0]), "float32")
    for layer in ff_layers(model):
        h = layer(h)
    model.built = True
    return model


def ff_layers(model):
    return [layer for layer in model.layers if isinstance(layer, FFDense)]


def compile_ff(model, **kwargs):
    """keras-io's compile, less its `loss="mse"` and `Mean()` metric, which
    its step never uses and Keras cannot build without a `call`."""
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.03), **kwargs)


# -- transfer learning: freeze, train, unfreeze, re-compile, fine-tune ------------


def transfer_learning_model():
    """keras-io's `guides/transfer_learning.py` end to end, its base (an
    Xception there) a small convnet with BatchNormalization, trained on
    digits as the "pre-trained" weights. Returns `(model, base_model)`,
    the base frozen, as the guide has it before its first `fit`."""
    keras.utils.set_random_seed(5)
    x, y = digits()
    base_model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(8, 3, padding="same", name="conv1"),
            layers.BatchNormalization(name="bn1"),
            layers.ReLU(),
            layers.Conv2D(8, 3, padding="same", name="conv2"),
            layers.GlobalAveragePooling2D(),
        ],
        name="base",
    )
    pretrain = keras.Sequential([base_model, layers.Dense(10)])
    pretrain.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    pretrain.fit(x, y, epochs=2, batch_size=64, verbose=0)

    base_model.trainable = False
    inputs = keras.Input(shape=(8, 8, 1))
    scale_layer = layers.Rescaling(scale=2.0, offset=-1.0)
    h = scale_layer(inputs)
    # The base model runs in inference mode, also once it is unfrozen.
    h = base_model(h, training=False)
    h = layers.Dropout(0.2)(h)
    outputs = layers.Dense(1)(h)
    return keras.Model(inputs, outputs), base_model


def transfer_learning_data():
    """The guide's binary task (cats or dogs): is the digit even?"""
    x, y = digits()
    return x, (y % 2 == 0).astype("float32")


# -- DDIM: a normalizer and an EMA network in the train step ------------------------

DDIM_IMAGE_SIZE = 8
DDIM_BATCH = 32
EMBEDDING_DIMS = 8
EMBEDDING_MAX_FREQUENCY = 1000.0
MIN_SIGNAL_RATE = 0.02
MAX_SIGNAL_RATE = 0.95
EMA = 0.999


@keras.saving.register_keras_serializable(package="keras_io")  # for clone_model here
def sinusoidal_embedding(x):
    import math

    import tensorflow as tf

    embedding_min_frequency = 1.0
    frequencies = tf.exp(
        tf.linspace(
            tf.math.log(embedding_min_frequency),
            tf.math.log(EMBEDDING_MAX_FREQUENCY),
            EMBEDDING_DIMS // 2,
        )
    )
    angular_speeds = 2.0 * math.pi * frequencies
    embeddings = tf.concat([tf.sin(angular_speeds * x), tf.cos(angular_speeds * x)], axis=3)
    return embeddings


def ResidualBlock(width):
    def apply(x):
        input_width = x.shape[3]
        if input_width == width:
            residual = x
        else:
            residual = layers.Conv2D(width, kernel_size=1)(x)
        x = layers.BatchNormalization(center=False, scale=False)(x)
        x = layers.Conv2D(width, kernel_size=3, padding="same", activation=keras.activations.swish)(
            x
        )
        x = layers.Conv2D(width, kernel_size=3, padding="same")(x)
        x = layers.Add()([x, residual])
        return x

    return apply


def DownBlock(width, block_depth):
    def apply(x):
        x, skips = x
        for _ in range(block_depth):
            x = ResidualBlock(width)(x)
            skips.append(x)
        x = layers.AveragePooling2D(pool_size=2)(x)
        return x

    return apply


def UpBlock(width, block_depth):
    def apply(x):
        x, skips = x
        x = layers.UpSampling2D(size=2, interpolation="bilinear")(x)
        for _ in range(block_depth):
            x = layers.Concatenate()([x, skips.pop()])
            x = ResidualBlock(width)(x)
        return x

    return apply


def get_network(image_size, widths, block_depth):
    noisy_images = keras.Input(shape=(image_size, image_size, 1))
    noise_variances = keras.Input(shape=(1, 1, 1))

    e = layers.Lambda(sinusoidal_embedding)(noise_variances)
    e = layers.UpSampling2D(size=image_size, interpolation="nearest")(e)

    x = layers.Conv2D(widths[0], kernel_size=1)(noisy_images)
    x = layers.Concatenate()([x, e])

    skips = []
    for width in widths[:-1]:
        x = DownBlock(width, block_depth)([x, skips])

    for _ in range(block_depth):
        x = ResidualBlock(widths[-1])(x)

    for width in reversed(widths[:-1]):
        x = UpBlock(width, block_depth)([x, skips])

    x = layers.Conv2D(1, kernel_size=1, kernel_initializer="zeros")(x)

    return keras.Model([noisy_images, noise_variances], x, name="residual_unet")


class DiffusionModel(keras.Model):
    """keras-io's `examples/generative/ddim.py` model (TensorFlow), less its
    KID metric (an ImageNet InceptionV3): a `Normalization` and the
    diffusion schedule in its `train_step`, an EMA copy of the network
    updated by `assign`. `ema_cast=True` is the line the guide gives for
    an EMA network kept in float32 beside half weights (O3)."""

    def __init__(self, image_size, widths, block_depth, ema_cast=False):
        super().__init__()

        self.normalizer = layers.Normalization()
        self.network = get_network(image_size, widths, block_depth)
        self.ema_network = keras.models.clone_model(self.network)
        self.ema_cast = ema_cast

    def compile(self, **kwargs):
        super().compile(**kwargs)

        self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")
        self.image_loss_tracker = keras.metrics.Mean(name="i_loss")

    @property
    def metrics(self):
        return [self.noise_loss_tracker, self.image_loss_tracker]

    def diffusion_schedule(self, diffusion_times):
        import tensorflow as tf

        start_angle = tf.acos(MAX_SIGNAL_RATE)
        end_angle = tf.acos(MIN_SIGNAL_RATE)
        diffusion_angles = start_angle + diffusion_times * (end_angle - start_angle)
        signal_rates = tf.cos(diffusion_angles)
        noise_rates = tf.sin(diffusion_angles)
        return noise_rates, signal_rates

    def denoise(self, noisy_images, noise_rates, signal_rates, training):
        if training:
            network = self.network
        else:
            network = self.ema_network
        pred_noises = network([noisy_images, noise_rates**2], training=training)
        pred_images = (noisy_images - noise_rates * pred_noises) / signal_rates
        return pred_noises, pred_images

    def train_step(self, images):
        import tensorflow as tf

        images = self.normalizer(images, training=True)
        noises = tf.random.normal(shape=(DDIM_BATCH, DDIM_IMAGE_SIZE, DDIM_IMAGE_SIZE, 1))
        diffusion_times = tf.random.uniform(shape=(DDIM_BATCH, 1, 1, 1), minval=0.0, maxval=1.0)
        noise_rates, signal_rates = self.diffusion_schedule(diffusion_times)
        noisy_images = signal_rates * images + noise_rates * noises

        with tf.GradientTape() as tape:
            pred_noises, pred_images = self.denoise(
                noisy_images, noise_rates, signal_rates, training=True
            )
            noise_loss = self.loss(noises, pred_noises)  # used for training
            image_loss = self.loss(images, pred_images)  # only used as metric

        gradients = tape.gradient(noise_loss, self.network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.network.trainable_weights))

        self.noise_loss_tracker.update_state(noise_loss)
        self.image_loss_tracker.update_state(image_loss)

        for weight, ema_weight in zip(self.network.weights, self.ema_network.weights):
            if self.ema_cast:  # the guide's line for a float32 EMA beside half weights
                weight = ops.cast(weight, ema_weight.dtype)
            ema_weight.assign(EMA * ema_weight + (1 - EMA) * weight)

        return {m.name: m.result() for m in self.metrics}


def ddim(ema_cast=False):
    """A tiny DDIM (widths 8, 16; one block deep) with its normalizer
    adapted to the digits, seeded; and its training images."""
    keras.utils.set_random_seed(6)
    x, _ = digits(DDIM_BATCH * 4)
    model = DiffusionModel(DDIM_IMAGE_SIZE, [8, 16], 1, ema_cast=ema_cast)
    model.normalizer.adapt(x)
    return model, x


def compile_ddim(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
        loss=keras.losses.mean_absolute_error,
        **kwargs,
    )


# -- neural style transfer: a feature extractor, every layer an output -------------

NST_SIZE = 16
STYLE_LAYER_NAMES = ["block1_conv1", "block2_conv1", "block3_conv1"]
CONTENT_LAYER_NAME = "block3_conv2"


def vgg_like():
    """VGG19's layer names and shape (conv blocks, max pooling), 8 filters a
    convolution, random weights: keras-io's `vgg19.VGG19(include_top=False)`
    without its ImageNet download."""
    keras.utils.set_random_seed(7)
    stack = [keras.Input((NST_SIZE, NST_SIZE, 3))]
    for block, convs in ((1, 2), (2, 2), (3, 2)):
        for i in range(1, convs + 1):
            stack.append(
                layers.Conv2D(8, 3, padding="same", activation="relu", name=f"block{block}_conv{i}")
            )
        stack.append(layers.MaxPooling2D(name=f"block{block}_pool"))
    return keras.Sequential(stack, name="vgg19")


def feature_extractor():
    model = vgg_like()
    outputs_dict = dict([(layer.name, layer.output) for layer in model.layers])
    return keras.Model(inputs=model.inputs, outputs=outputs_dict)


def style_transfer_loss(feature_extractor, combination_image, base_image, style_reference_image):
    """keras-io's `compute_loss` (content, style and total variation)."""
    content_weight, style_weight, total_variation_weight = 2.5e-8, 1e-6, 1e-6
    rows = cols = NST_SIZE

    def gram_matrix(x):
        x = ops.transpose(x, (2, 0, 1))
        features = ops.reshape(x, (ops.shape(x)[0], -1))
        return ops.matmul(features, ops.transpose(features))

    def style_loss(style, combination):
        S = gram_matrix(style)
        C = gram_matrix(combination)
        channels = 3
        size = rows * cols
        return ops.sum(ops.square(S - C)) / (4.0 * (channels**2) * (size**2))

    def content_loss(base, combination):
        return ops.sum(ops.square(combination - base))

    def total_variation_loss(x):
        a = ops.square(x[:, : rows - 1, : cols - 1, :] - x[:, 1:, : cols - 1, :])
        b = ops.square(x[:, : rows - 1, : cols - 1, :] - x[:, : rows - 1, 1:, :])
        return ops.sum(ops.power(a + b, 1.25))

    input_tensor = ops.concatenate([base_image, style_reference_image, combination_image], axis=0)
    features = feature_extractor(input_tensor)
    loss = ops.zeros(shape=())
    layer_features = features[CONTENT_LAYER_NAME]
    loss = loss + content_weight * content_loss(layer_features[0], layer_features[2])
    for layer_name in STYLE_LAYER_NAMES:
        layer_features = features[layer_name]
        sl = style_loss(layer_features[1], layer_features[2])
        loss += (style_weight / len(STYLE_LAYER_NAMES)) * sl
    loss += total_variation_weight * total_variation_loss(combination_image)
    return loss


def style_transfer_images():
    """Two 16x16 "photos" (digits, coloured), as `preprocess_input` leaves them."""
    x, _ = digits(2)
    rgb = np.repeat(np.kron(x[..., 0], np.ones((2, 2)))[..., None], 3, axis=-1)
    images = (rgb * 255.0 - np.array([103.939, 116.779, 123.68])).astype("float32")
    return images[:1], images[1:2]


# -- WGAN-GP: a gradient penalty, three discriminator steps per generator step -----


def wgan_discriminator():
    img_input = layers.Input(shape=(8, 8, 1))
    x = layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same")(img_input)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same")(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Dropout(0.3)(x)
    x = layers.Flatten()(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Dense(1)(x)
    return keras.models.Model(img_input, x, name="discriminator")


def wgan_generator():
    noise = layers.Input(shape=(LATENT,))
    x = layers.Dense(2 * 2 * 16, use_bias=False)(noise)
    x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Reshape((2, 2, 16))(x)
    for filters, activation in ((8, layers.LeakyReLU(0.2)), (1, layers.Activation("tanh"))):
        x = layers.UpSampling2D((2, 2))(x)
        x = layers.Conv2D(filters, (3, 3), padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = activation(x)
    return keras.models.Model(noise, x, name="generator")


class WGAN(keras.Model):
    """keras-io's `examples/generative/wgan_gp.py` WGAN, as written (TensorFlow)."""

    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = 10.0

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        import tensorflow as tf

        alpha = tf.random.normal([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        import tensorflow as tf

        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        for _ in range(self.d_steps):
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def wgan():
    keras.utils.set_random_seed(8)
    return WGAN(wgan_discriminator(), wgan_generator(), LATENT)


def compile_wgan(model):
    def discriminator_loss(real_img, fake_img):
        return ops.mean(fake_img) - ops.mean(real_img)

    def generator_loss(fake_img):
        return -ops.mean(fake_img)

    model.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=2e-3, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(learning_rate=2e-3, beta_1=0.5, beta_2=0.9),
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )


# -- CycleGAN: four optimizers, one persistent tape -----------------------------------


class ReflectionPadding2D(layers.Layer):
    """keras-io's CycleGAN padding layer (`tf.pad`, mode REFLECT)."""

    def __init__(self, padding=(1, 1), **kwargs):
        self.padding = tuple(padding)
        super().__init__(**kwargs)

    def call(self, input_tensor, mask=None):
        import tensorflow as tf

        padding_width, padding_height = self.padding
        padding_tensor = [
            [0, 0],
            [padding_height, padding_height],
            [padding_width, padding_width],
            [0, 0],
        ]
        return tf.pad(input_tensor, padding_tensor, mode="REFLECT")


def _instance_norm():
    return layers.GroupNormalization(groups=-1)  # tfa's InstanceNormalization in Keras 3


def cyclegan_generator(name):
    img_input = layers.Input(shape=(8, 8, 1), name=name + "_img_input")
    x = ReflectionPadding2D(padding=(1, 1))(img_input)
    x = layers.Conv2D(8, (3, 3), use_bias=False)(x)
    x = _instance_norm()(x)
    x = layers.Activation("relu")(x)
    x = layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same", use_bias=False)(x)
    x = _instance_norm()(x)
    x = layers.Activation("relu")(x)
    residual = x
    x = ReflectionPadding2D()(x)
    x = layers.Conv2D(16, (3, 3), use_bias=False)(x)
    x = _instance_norm()(x)
    x = layers.add([residual, x])
    x = layers.Conv2DTranspose(8, (3, 3), strides=(2, 2), padding="same", use_bias=False)(x)
    x = _instance_norm()(x)
    x = layers.Activation("relu")(x)
    x = ReflectionPadding2D(padding=(1, 1))(x)
    x = layers.Conv2D(1, (3, 3), padding="valid")(x)
    x = layers.Activation("tanh")(x)
    return keras.models.Model(img_input, x, name=name)


def cyclegan_discriminator(name):
    img_input = layers.Input(shape=(8, 8, 1), name=name + "_img_input")
    x = layers.Conv2D(8, (4, 4), strides=(2, 2), padding="same")(img_input)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Conv2D(16, (4, 4), strides=(2, 2), padding="same", use_bias=False)(x)
    x = _instance_norm()(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Conv2D(1, (4, 4), strides=(1, 1), padding="same")(x)
    return keras.models.Model(inputs=img_input, outputs=x, name=name)


class CycleGan(keras.Model):
    """keras-io's `examples/generative/cyclegan.py` model, as written (TensorFlow)."""

    def __init__(self, generator_G, generator_F, discriminator_X, discriminator_Y):
        super().__init__()
        self.gen_G = generator_G
        self.gen_F = generator_F
        self.disc_X = discriminator_X
        self.disc_Y = discriminator_Y
        self.lambda_cycle = 10.0
        self.lambda_identity = 0.5

    def compile(
        self,
        gen_G_optimizer,
        gen_F_optimizer,
        disc_X_optimizer,
        disc_Y_optimizer,
        gen_loss_fn,
        disc_loss_fn,
    ):
        super().compile()
        self.gen_G_optimizer = gen_G_optimizer
        self.gen_F_optimizer = gen_F_optimizer
        self.disc_X_optimizer = disc_X_optimizer
        self.disc_Y_optimizer = disc_Y_optimizer
        self.generator_loss_fn = gen_loss_fn
        self.discriminator_loss_fn = disc_loss_fn
        self.cycle_loss_fn = keras.losses.MeanAbsoluteError()
        self.identity_loss_fn = keras.losses.MeanAbsoluteError()

    def train_step(self, batch_data):
        import tensorflow as tf

        real_x, real_y = batch_data
        with tf.GradientTape(persistent=True) as tape:
            fake_y = self.gen_G(real_x, training=True)
            fake_x = self.gen_F(real_y, training=True)
            cycled_x = self.gen_F(fake_y, training=True)
            cycled_y = self.gen_G(fake_x, training=True)
            same_x = self.gen_F(real_x, training=True)
            same_y = self.gen_G(real_y, training=True)
            disc_real_x = self.disc_X(real_x, training=True)
            disc_fake_x = self.disc_X(fake_x, training=True)
            disc_real_y = self.disc_Y(real_y, training=True)
            disc_fake_y = self.disc_Y(fake_y, training=True)
            gen_G_loss = self.generator_loss_fn(disc_fake_y)
            gen_F_loss = self.generator_loss_fn(disc_fake_x)
            cycle_loss_G = self.cycle_loss_fn(real_y, cycled_y) * self.lambda_cycle
            cycle_loss_F = self.cycle_loss_fn(real_x, cycled_x) * self.lambda_cycle
            id_loss_G = (
                self.identity_loss_fn(real_y, same_y) * self.lambda_cycle * self.lambda_identity
            )
            id_loss_F = (
                self.identity_loss_fn(real_x, same_x) * self.lambda_cycle * self.lambda_identity
            )
            total_loss_G = gen_G_loss + cycle_loss_G + id_loss_G
            total_loss_F = gen_F_loss + cycle_loss_F + id_loss_F
            disc_X_loss = self.discriminator_loss_fn(disc_real_x, disc_fake_x)
            disc_Y_loss = self.discriminator_loss_fn(disc_real_y, disc_fake_y)
        grads_G = tape.gradient(total_loss_G, self.gen_G.trainable_variables)
        grads_F = tape.gradient(total_loss_F, self.gen_F.trainable_variables)
        disc_X_grads = tape.gradient(disc_X_loss, self.disc_X.trainable_variables)
        disc_Y_grads = tape.gradient(disc_Y_loss, self.disc_Y.trainable_variables)
        self.gen_G_optimizer.apply_gradients(zip(grads_G, self.gen_G.trainable_variables))
        self.gen_F_optimizer.apply_gradients(zip(grads_F, self.gen_F.trainable_variables))
        self.disc_X_optimizer.apply_gradients(zip(disc_X_grads, self.disc_X.trainable_variables))
        self.disc_Y_optimizer.apply_gradients(zip(disc_Y_grads, self.disc_Y.trainable_variables))
        return {
            "G_loss": total_loss_G,
            "F_loss": total_loss_F,
            "D_X_loss": disc_X_loss,
            "D_Y_loss": disc_Y_loss,
        }


def cyclegan():
    keras.utils.set_random_seed(9)
    return CycleGan(
        cyclegan_generator("generator_G"),
        cyclegan_generator("generator_F"),
        cyclegan_discriminator("discriminator_X"),
        cyclegan_discriminator("discriminator_Y"),
    )


def compile_cyclegan(model):
    adv_loss_fn = keras.losses.MeanSquaredError()

    def generator_loss_fn(fake):
        return adv_loss_fn(ops.ones_like(fake), fake)

    def discriminator_loss_fn(real, fake):
        real_loss = adv_loss_fn(ops.ones_like(real), real)
        fake_loss = adv_loss_fn(ops.zeros_like(fake), fake)
        return (real_loss + fake_loss) * 0.5

    model.compile(
        **{
            f"{name}_optimizer": keras.optimizers.Adam(learning_rate=2e-3, beta_1=0.5)
            for name in ("gen_G", "gen_F", "disc_X", "disc_Y")
        },
        gen_loss_fn=generator_loss_fn,
        disc_loss_fn=discriminator_loss_fn,
    )


def cyclegan_data():
    """Horses and zebras: digits and their mirror images, in [-1, 1]."""
    x, _ = digits(64)
    x = x * 2.0 - 1.0
    return x, x[:, :, ::-1, :].copy()
