"""The small models and data the unit tests share (tests/zoo has the real
model families): Dense, convolutions, BatchNormalization, LayerNormalization
and a softmax output, the kinds of layer the levels treat differently."""

import keras
import numpy as np


def dense_bn_classifier(width=16):
    """6 features -> Dense(width, relu) "hidden" -> BatchNorm "bn" ->
    Dense(3, softmax) "out", seeded: the same initial weights at every call."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )


def three_class_data(rows):
    """`rows` standard-normal samples of 6 features and their class: how many
    of the first two features are positive. A longer draw starts with the
    rows of a shorter one."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def small_cnn():
    """8x8x1 images -> conv, bn, relu, flatten, hidden, ln, logits, probs
    (Softmax, the output): one layer of each kind, seeded."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(name="relu"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(3, name="logits"),
            keras.layers.Softmax(name="probs"),
        ],
        name="cnn",
    )


def functional_classifier():
    """`dense_bn_classifier` as a functional model: input "features", Dense
    "hidden", BatchNorm "bn", Dense softmax "probs"; seeded."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    return keras.Model(inputs, outputs)


def o3_classifier(optimizer, dtype="bfloat16", **amp):
    """`dense_bn_classifier` compiled at O3 in `dtype` (half variables),
    with the optimizer and amp settings given."""
    model = dense_bn_classifier()
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        amp_level="O3",
        amp_dtype=dtype,
        **amp,
    )
    return model


def half_weights(model):
    """The model's float16 and bfloat16 trainable variables."""
    return [v for v in model.trainable_variables if v.dtype in ("float16", "bfloat16")]
