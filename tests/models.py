"""The small model and data the unit tests share (tests/zoo has the real
model families): Dense, BatchNormalization and a softmax output, the three
kinds of layer the levels treat differently."""

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
