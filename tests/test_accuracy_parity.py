"""Training parity on real data: scikit-learn's bundled digits (no download).

A small CNN trained at O1 (bfloat16), O2 (float16, with its dynamic loss
scale) and O3 (bfloat16, with float32 master weights or with compensation
buffers) from the float32 (O0) run's initial weights, on the same batches,
follows that run step by step: each step's loss within the half dtype's
rounding, no step skipped, and the weights at the end where float32's are.
On every backend: each runs the step, the skip and the master weights its
own way.

Why step by step and not an accuracy after epochs: a run's test accuracy
moves by a new seed's worth (1.3 points on 597 images) with any change in
the arithmetic, and a bound loose enough for that took 3 seeds x 40 epochs
a cell. Here the weights of a level end 2.5-6% of float32's movement from
float32's (every backend); O3 whose master copies are rounded to bfloat16
at each step (its small updates lost, as without master weights) ends
15-16% away, and a skipped or lost step moves every later loss.
"""

import functools

import keras
import numpy as np
import pytest

sklearn_datasets = pytest.importorskip("sklearn.datasets")

STEPS = 30
BATCH = 64
TRAIN = 1200
# A step's relative loss difference from float32's: the largest a level's
# own rounding gave over these steps was 0.16% (bfloat16) and 0.07%
# (float16); the weights' distance from float32's, over float32's movement,
# 6.2% at most, 15.4% with the master copies rounded at each step.
RTOL = {"bfloat16": 1e-2, "float16": 5e-3}
TRAJECTORY = 0.1


@functools.cache
def _digits():
    digits = sklearn_datasets.load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    return x[order][:TRAIN], y[order][:TRAIN]


def _losses(level, dtype, **amp):
    """Each step's loss (taken before its update) of the digits CNN at
    `level`, from seed 0's weights, on the same `STEPS` batches."""
    x, y = _digits()
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
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        amp_dtype=dtype,
        **amp,
    )
    initial = [_float32(w) for w in model.trainable_weights]
    means = []  # the epoch's running mean of the loss after each step
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: means.append(float(logs["loss"]))
    )
    steps = np.arange(STEPS * BATCH) % TRAIN
    model.fit(
        x[steps], y[steps], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record]
    )
    counted = np.arange(1, STEPS + 1) * np.array(means)
    losses = np.diff(counted, prepend=0.0)
    skipped = getattr(model.optimizer, "skipped_steps", None)
    skipped = None if skipped is None else int(keras.ops.convert_to_numpy(skipped))
    return losses, initial, [_float32(w) for w in model.trainable_weights], skipped


def _float32(w):
    return np.asarray(keras.ops.convert_to_numpy(w), "float32")


def _distance(a, b):
    return np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b)))


@pytest.fixture(scope="module")
def float32_run():
    losses, initial, weights, _ = _losses("O0", "float16")
    assert losses[-1] < 0.95 * losses[0], losses  # what the others follow trains
    return losses, initial, weights


@pytest.mark.parametrize(
    "level, dtype, amp",
    [
        ("O1", "bfloat16", {}),
        ("O2", "float16", {}),
        ("O3", "bfloat16", {"master_weights": True}),
        ("O3", "bfloat16", {"master_weights": "compensated"}),
    ],
    ids=["O1-bfloat16", "O2-float16", "O3-bfloat16-master", "O3-bfloat16-compensated"],
)
def test_each_step_follows_float32(float32_run, level, dtype, amp):
    float32_losses, initial, float32_weights = float32_run
    losses, _, weights, skipped = _losses(level, dtype, **amp)
    assert skipped in (None, 0)  # the default scale: no step of this model overflows
    np.testing.assert_allclose(losses, float32_losses, rtol=RTOL[dtype])
    # Where the weights ended, against how far float32's moved them.
    off = _distance(weights, float32_weights) / _distance(float32_weights, initial)
    assert off < TRAJECTORY, off
