"""The callbacks: loss-scale telemetry in `fit`'s logs (the progress bar, the
epoch's logs, TensorBoard), and `OverflowGuard`.

The values each backend's step puts in its logs are checked on each backend;
what the callbacks make of the logs (the bar's text, TensorBoard's scalars,
the guard's and the warning's decisions) is proven once (`one_backend`).

The logged values are checked step by step against the pure-Python reference
state machine driven by the same finite/non-finite pattern, and at epoch ends
against the optimizer's own variables.
"""

import glob
import os
import re
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.callbacks import OverflowGuard
from tests.model.logged_runs import BATCH
from tests.model.logged_runs import STEPS
from tests.model.logged_runs import BatchLogs
from tests.model.logged_runs import data
from tests.model.logged_runs import model_at
from tests.model.logged_runs import read_value
from tests.model.logged_runs import reference_trace

BACKEND = keras.backend.backend()


@pytest.mark.parametrize("amp_level", ["O2", None])
def test_logs_follow_the_state_machine_step_by_step(amp_level):
    model = model_at(amp_level=amp_level)
    recorder = BatchLogs()
    x, y = data()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]
    )
    expected = reference_trace(epochs=2)
    assert recorder.batches == expected
    # History and the epoch-end logs hold the optimizer's own state.
    assert history.history["loss_scale"] == [scale for scale, _ in recorder.epochs]
    assert history.history["skipped_steps"] == [skipped for _, skipped in recorder.epochs]
    assert recorder.epochs == [expected[STEPS - 1], expected[-1]]
    # Under amp_level a skipped batch is not averaged into the epoch's loss;
    # a plain compile keeps Keras's metrics as they are (NaN included).
    assert np.all(np.isfinite(history.history["loss"])) == (amp_level is not None)


# The step without the values in its logs is each backend's own; the None
# cell's metrics (unguarded) are the cell of `test_logs_follow_...` above.
# The live bar (`verbose=1`) has the values in each step's logs, on each
# backend; the bar's formatting for `verbose=2` is the same code.
@pytest.mark.parametrize("verbose", [1, pytest.param(2, marks=pytest.mark.one_backend)])
def test_progress_bar_shows_the_loss_scale_and_the_count_as_whole_numbers(capsys, verbose):
    model = model_at()
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=verbose)
    final = capsys.readouterr().out.strip().split("\r")[-1]
    # After the epoch (reference: 16, 8 at the NaN step, 16, 8 again, then one
    # clean step).
    assert re.search(r"loss_scale: 8 - skipped_steps: 2\b", final), final
    x, y = data(nan_steps=())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=verbose)
    final = capsys.readouterr().out.strip().split("\r")[-1]
    assert re.search(r"skipped_steps: 2\b", final) and "e+00" not in final, final


@pytest.mark.one_backend
def test_a_progress_bar_of_ones_own_is_kept(capsys):
    model = model_at()
    x, y = data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=1,
        callbacks=[keras.callbacks.ProgbarLogger()],
    )
    assert "skipped_steps: 2.0000" in capsys.readouterr().out  # Keras's formatting


@pytest.mark.one_backend
def test_tensorboard_gets_the_scalars(tmp_path):
    import tensorflow as tf

    model = model_at()
    x, y = data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path))],
    )
    scalars = {}
    for path in glob.glob(os.path.join(str(tmp_path), "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):
                    scalars.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert scalars["epoch_loss_scale"] == history.history["loss_scale"]
    assert scalars["epoch_skipped_steps"] == history.history["skipped_steps"]


@pytest.mark.one_backend
def test_plain_keras_optimizer_has_no_telemetry():
    model = model_at(optimizer=keras.optimizers.SGD(1e-2), amp_level=None)
    x, y = data(nan_steps=())
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert set(history.history) == {"loss"}
    assert "train_step" not in model.__dict__


# -- OverflowGuard ------------------------------------------------------------


# -- a run whose steps are mostly skipped ---------------------------------------


def _prices():
    """A regression on unnormalised prices (5e4 to 3e5): its float16
    gradients overflow at a loss scale of 1 and need one below it."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (256, 4)).astype("float32")
    y = 5e4 + 2.5e5 * x @ np.array([[0.4], [0.3], [0.2], [0.1]], "float32")
    return x, y


def _fit_prices(epochs, optimizer_arguments=None, amp_level="O2"):
    """`(mse, skipped steps, the keras_mp warnings of mostly skipped steps
    seen)`, each at each epoch's end, of a Dense(8) -> Dense(1) on `_prices`
    (32 steps an epoch)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.Adam(10.0)
    if optimizer_arguments is not None:
        optimizer = keras_mp.LossScaleOptimizer(optimizer, **optimizer_arguments)
    model.compile(
        optimizer=optimizer, loss="mse", **({"amp_level": amp_level} if amp_level else {})
    )
    seen = []

    def on_epoch_end(epoch, logs):
        seen.append(
            [str(w.message) for w in caught if "training steps were skipped" in str(w.message)]
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            *_prices(),
            batch_size=8,
            epochs=epochs,
            verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)],
        )
    return history.history["loss"], history.history.get("skipped_steps"), seen


@pytest.mark.one_backend
def test_a_regression_on_prices_trains_in_float16():
    """tf.keras 2's floor of 1 (`min_scale=1.0`, the default before) kept the
    scale where these gradients overflow: every step skipped, MSE 3.3e10.
    Without a floor the scale falls to 2**-9 in 24 steps and the run trains
    as float32 does, without a word."""
    float32_mse = _fit_prices(5, amp_level=None)[0][-1]
    mse, skipped, seen = _fit_prices(5)
    assert mse[-1] < 4 * float32_mse, (mse[-1], float32_mse)
    assert mse[-1] < 1e-3 * mse[0]
    # The scale's fall from 2**15 to 2**-9 or 2**-10 (of 160 steps).
    assert skipped[-1] <= 26, skipped
    assert seen[-1] == []  # a healthy run: no warning


@pytest.mark.one_backend
def test_a_mostly_skipped_run_says_so_while_it_runs():
    mse, skipped, seen = _fit_prices(3, optimizer_arguments={"min_scale": 1.0})
    assert skipped[-1] == 96 and mse[-1] > 1e10  # every step skipped
    # At the second epoch's end (the first gives the window's start), once.
    assert seen[0] == [] and len(seen[1]) == 1 and len(seen[2]) == 1
    (message,) = seen[1]
    assert "32 of the last 32 training steps were skipped" in message
    # The advice fits the cause: the floor, and the targets' scale.
    assert "the lowest scale that min_scale=1 allows" in message and "`min_scale=None`" in message
    assert "normalize the targets" in message
    assert "does not help" in message  # not a lower learning rate


@pytest.mark.one_backend
def test_guard_stops_a_diverged_model():
    # Weights of 300 in float16: the hidden activations pass float16's 65504,
    # every step overflows, whatever the scale.
    model = model_at(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.SGD(1e-2), min_scale=2.0**-20),
        kernel=300.0,
    )
    guard = OverflowGuard(patience=5, verbose=0)
    x, y = data(nan_steps=())
    x *= 10
    history = model.fit(
        x, y, batch_size=BATCH, epochs=10, shuffle=False, verbose=0, callbacks=[guard]
    )
    assert guard.stopped_step == 4  # the fifth skipped step in a row
    assert model.stop_training
    assert len(history.history["loss"]) == 1  # stopped in the first epoch
    assert "5 steps in a row were skipped" in guard.message
    assert "loss scale is 1024" in guard.message  # 2**15 halved 5 times
    assert "keras_mp.analyze" in guard.message and "bfloat16" in guard.message
    assert read_value(model.optimizer.iterations) == 0  # nothing was applied


@pytest.mark.one_backend
def test_guard_stops_when_the_scale_is_pinned_at_min_scale(capsys):
    model = model_at(
        optimizer=keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(1e-2), initial_scale=4.0, min_scale=1.0
        ),
        kernel=300.0,
    )
    guard = OverflowGuard(patience=100)
    x, y = data(nan_steps=())
    x *= 10
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[guard])
    # Scales 4 -> 2 -> 1 (steps 0 and 1), step 2 overflows at 1: pinned.
    assert guard.stopped_step == 2
    assert "pinned at min_scale=1" in guard.message
    # Advice that fits a scale pinned at its floor: a lower floor, not a
    # lower learning rate.
    assert "`min_scale=None`" in guard.message and "does not help" in guard.message
    assert "OverflowGuard stopped training" in capsys.readouterr().out


@pytest.mark.one_backend
def test_guard_lets_a_healthy_run_with_occasional_skips_finish():
    model = model_at()
    guard = OverflowGuard(patience=2)
    x, y = data()  # two isolated NaN batches per epoch
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[guard]
    )
    assert guard.stopped_step is None and guard.message is None
    assert len(history.history["loss"]) == 3
    assert history.history["skipped_steps"][-1] == 6


@pytest.mark.one_backend
def test_guard_counts_a_streak_across_epochs():
    model = model_at()
    guard = OverflowGuard(patience=2, verbose=0)
    x, y = data(nan_steps=(0, 5))  # the last step of an epoch, then the first
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == STEPS  # first step of the second epoch


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"patience": 0}, ValueError, "patience=0"),
        ({"patience": "3"}, ValueError, "patience='3'"),
        ({"patience": True}, ValueError, "patience=True"),
        ({"stop_at_min_scale": "yes"}, TypeError, "stop_at_min_scale='yes'"),
        ({"verbose": 2}, ValueError, "verbose=2"),
    ],
)
def test_guard_rejects_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        OverflowGuard(**kwargs)


@pytest.mark.one_backend
def test_guard_needs_keras_mp_optimizer():
    model = model_at(optimizer=keras.optimizers.SGD(), amp_level=None)
    x, y = data(nan_steps=())
    with pytest.raises(TypeError, match="keras_mp.LossScaleOptimizer.*Received: optimizer="):
        model.fit(x, y, verbose=0, callbacks=[OverflowGuard()])
    unchecked = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=8.0, skip_on_overflow=False
    )
    model = model_at(optimizer=unchecked, amp_level=None)
    with pytest.raises(ValueError, match="skip_on_overflow=False"):
        model.fit(x, y, verbose=0, callbacks=[OverflowGuard()])


def test_a_run_whose_loss_is_infinite_at_every_scale_says_so():
    """Targets whose squares overflow float32: the loss is inf at any scale,
    every step is skipped and the scale falls without end (no floor). The
    fall explains the skips only down to 2**-24 (a float16 gradient that
    overflows below it is over 1e12): the warning comes at the second
    epoch's end (the first starts its window), not after the scale's 141
    back-offs to 2**-126."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", amp_level="O2")
    x, y = _prices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y * 1e20, batch_size=8, epochs=2, verbose=0)
    assert history.history["skipped_steps"] == [32, 64]
    assert [w for w in caught if "32 of the last 32 training steps" in str(w.message)]
