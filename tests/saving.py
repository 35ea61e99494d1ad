"""What the saving tests share: a small classifier trained a few steps on data
with a NaN batch, its full state, and models holding a block of your own."""

import keras
import numpy as np

import keras_mp
from tests import models

BACKEND = keras.backend.backend()
BATCH = 8
STEPS_PER_EPOCH = 4
NAN_BATCH = 1


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).astype("float64")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 6)).astype("float32")
    y = ((x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)).astype("int32")
    x[NAN_BATCH * BATCH + 2, 3] = np.nan  # one step per epoch is skipped
    return x, y


def classifier():
    return models.functional_classifier()


def compiled(level="O2", dtype="float16", loss_scale="dynamic", master_weights=True):
    model = classifier()
    if loss_scale == "dynamic":
        # Grows after 3 finite steps: the scale moves both ways in a short run.
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2),
            initial_scale=2.0**8,
            dynamic_growth_steps=3,
            master_weights=master_weights,
        )
    else:
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2),
            dynamic=False,
            initial_scale=loss_scale,
            master_weights=master_weights,
        )
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level=level,
        amp_dtype=dtype,
    )
    return model


def fit(model, epochs, initial_epoch=0, callbacks=()):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def state(model):
    """Everything training depends on: weights, then optimizer variables."""
    return [numpy(v) for v in model.weights] + [numpy(v) for v in model.optimizer.variables]


def assert_same_state(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def policies(model):
    return [
        (layer.name, layer.dtype_policy.name)
        for layer in model._flatten_layers(include_self=True, recursive=True)
    ]


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class ResidualBlock(keras.layers.Layer):
    """A block as Keras's guides write one: its sublayers are made in
    `__init__` with no dtype (so in Keras's default policy), and its config
    does not hold them."""

    def __init__(self, units=16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, activation="relu")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class SubclassedWithBlock(keras.Model):
    """Its layers are named by Keras's counters, which differ in the process
    that loads it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.block = ResidualBlock(16)
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.block(self.hidden(x)))


def with_block():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    h = ResidualBlock(16, name="block")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    return keras.Model(inputs, outputs)


def adam_in_lso():
    return keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), initial_scale=2.0**8, dynamic_growth_steps=3
    )


def block_at_o3(model):
    model.compile(adam_in_lso(), "sparse_categorical_crossentropy", amp_level="O3")


def block_allowed_at_o2(model):
    model.compile(
        adam_in_lso(), "sparse_categorical_crossentropy", amp_level="O2", amp_allow=[ResidualBlock]
    )


def to_float_after_compile(model):
    model.compile(adam_in_lso(), "sparse_categorical_crossentropy", amp_level="O2")
    keras_mp.to_float(model.get_layer("hidden"), "float32")


def apply_amp_then_plain_compile(model):
    keras_mp.apply_amp(model, "O3", "bfloat16")
    model.compile(adam_in_lso(), "sparse_categorical_crossentropy")


def dense_denied_by_class(model):
    model.compile(
        adam_in_lso(),
        "sparse_categorical_crossentropy",
        amp_level="O2",
        amp_deny=[keras.layers.Dense],
    )


HOW_SET = {
    # TensorFlow could not load the first three: the block came back in
    # half, its sublayers in float32, and its `x + dense(x)` mixed them.
    "O3": (with_block, block_at_o3),
    "O2-allow-block": (with_block, block_allowed_at_o2),
    "apply_amp-then-plain-compile": (with_block, apply_amp_then_plain_compile),
    # These came back at the level: the precision set by hand, or through
    # layer names that Keras's counters give again differently, was lost.
    "to_float-after-compile": (with_block, to_float_after_compile),
    "subclassed-deny-by-class": (SubclassedWithBlock, dense_denied_by_class),
}


# -- one tiny model per shape, for every road back to a model -------------------


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class AttendingNet(keras.Model):
    """A subclassed model whose MultiHeadAttention makes its own layers when
    it is built (its softmax among them), with a softmax head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(8, activation="relu")
        self.attention = keras.layers.MultiHeadAttention(2, 4)
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        h = self.embed(x)
        return self.head(keras.ops.mean(self.attention(h, h), axis=1))


def _sequential():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _attention():
    inputs = keras.Input((4, 8))
    h = keras.layers.Flatten()(keras.layers.MultiHeadAttention(2, 4)(inputs, inputs))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))


def _gru():
    inputs = keras.Input((5, 4))
    return keras.Model(
        inputs, keras.layers.Dense(3, activation="softmax")(keras.layers.GRU(6)(inputs))
    )


def _subclassed():
    model = AttendingNet()
    model(np.zeros((1, 4, 8), "float32"))
    return model


# name: (build, half dtype, input shape). Inputs of a wide range, so that a
# softmax or a head computed in half rather than float32 shows in the outputs.
SHAPES = {
    "sequential_softmax_head": (_sequential, "float16", (6,)),
    "functional_attention": (_attention, "float16", (4, 8)),
    "functional_gru_bfloat16": (_gru, "bfloat16", (5, 4)),
    "subclassed_attention": (_subclassed, "float16", (4, 8)),
}


def shape(name, compiled):
    """The model of `SHAPES[name]` at O2 (by `compile(amp_level=...)` or by
    `apply_amp` alone), seeded, and its inputs."""
    build, dtype, input_shape = SHAPES[name]
    keras.utils.set_random_seed(0)
    model = build()
    if compiled:
        model.compile("adam", "mse", amp_level="O2", amp_dtype=dtype)
    else:
        keras_mp.apply_amp(model, "O2", dtype)
    x = np.random.default_rng(0).normal(size=(8, *input_shape)).astype("float32") * 4
    return model, x


def precision(model):
    """Each layer's class, compute and variable dtypes and rule, as
    `precision_summary` gives them."""
    return [
        (r["class"], r["compute_dtype"], r["variable_dtype"], r["rule"])
        for r in keras_mp.precision_summary(model).rows
    ]


def outputs(model, x):
    """`model(x)` in NumPy, in the dtype the model returns (a direct call: the
    precision each layer computes in is the model's, as in `predict`, without
    compiling a program per rebuilt model)."""
    return np.asarray(keras.ops.convert_to_numpy(model(x)))


def assert_computes_as(rebuilt, model, x, expected=None):
    """`rebuilt` computes what `model` does on `x` (`expected`, if given), bit
    for bit and in its dtype, each layer in the same precision for the same
    reason."""
    if expected is None:
        expected = outputs(model, x)
    got = outputs(rebuilt, x)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    assert precision(rebuilt) == precision(model)
