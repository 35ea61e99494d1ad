"""Accuracy parity on real data: scikit-learn's bundled digits (no download).

A small CNN trained at O0, O1 and O2, in float16 and bfloat16, with fixed
seeds and enough epochs to converge: every mixed-precision run's test
accuracy is within 1 point of the float32 (O0) run's.
"""

import keras
import numpy as np
import pytest

import keras_mp

sklearn_datasets = pytest.importorskip("sklearn.datasets")

EPOCHS = 60
BATCH = 64
TRAIN = 1200


def _digits():
    digits = sklearn_datasets.load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


def _accuracy(level, dtype):
    (x, y), (x_test, y_test) = _digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        # Decayed to zero: every run ends converged, not mid-oscillation.
        optimizer=keras.optimizers.Adam(
            keras.optimizers.schedules.CosineDecay(3e-3, EPOCHS * -(-TRAIN // BATCH))
        ),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level=level,
        amp_dtype=dtype,
    )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=True)
    return model.evaluate(x_test, y_test, verbose=0)[1]


@pytest.fixture(scope="module")
def float32_accuracy():
    accuracy = _accuracy("O0", "float16")
    assert accuracy > 0.9, f"the float32 baseline did not converge: {accuracy}"
    return accuracy


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mixed_precision_matches_float32(float32_accuracy, level, dtype):
    accuracy = _accuracy(level, dtype)
    assert abs(accuracy - float32_accuracy) <= 0.01, (level, dtype, accuracy, float32_accuracy)
