"""A small regression fitted with NaN batches at known steps, and the
pure-Python state machine's trace of the same pattern: shared by the tests of
the logs (`test_step_logs.py`) and of the callbacks (`test_callbacks.py`)."""

import keras
import numpy as np

import keras_mp
from tests.reference import ReferenceLossScale

BATCH = 8
STEPS = 6
NAN_STEPS = (1, 4)


def read_value(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).item()


def data(nan_steps=NAN_STEPS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = (x[:, :1] - x[:, 1:2]).astype("float32")
    for step in nan_steps:
        x[step * BATCH + 1, 2] = np.nan
    return x, y


def model_at(optimizer=None, amp_level="O2", kernel=None):
    keras.utils.set_random_seed(0)
    initializer = "glorot_uniform" if kernel is None else keras.initializers.Constant(kernel)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, kernel_initializer=initializer, name="hidden"),
            keras.layers.Dense(1, kernel_initializer=initializer, name="out"),
        ]
    )
    optimizer = optimizer or keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1e-2), initial_scale=2.0**4, dynamic_growth_steps=2
    )
    kwargs = {"amp_level": amp_level} if amp_level else {}
    model.compile(optimizer=optimizer, loss="mse", **kwargs)
    return model


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []
        self.epochs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((read_value(logs["loss_scale"]), read_value(logs["skipped_steps"])))

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        self.epochs.append((read_value(optimizer.loss_scale), read_value(optimizer.skipped_steps)))


def reference_trace(epochs):
    reference = ReferenceLossScale(initial_scale=2.0**4, dynamic_growth_steps=2)
    trace = []
    for _ in range(epochs):
        for step in range(STEPS):
            bad = [np.array([np.nan])] if step in NAN_STEPS else [np.array([1.0])]
            reference.step(bad)
            trace.append((float(reference.scale), reference.skipped_steps))
    return trace
