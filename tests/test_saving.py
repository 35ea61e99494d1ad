"""Saving and resuming mixed-precision models: `.keras`, checkpoints, backups.

A saved model loses nothing: per-layer policies, the LossScaleOptimizer with
its state (scale, counters, inner slots, iterations), the compile config.
Resuming is exact: N steps, save, load, M steps gives bit for bit what N+M
steps without the save gives (compared against that uninterrupted run). The
data has a NaN batch, so the runs include skipped steps, backoffs and growth.
"""

import json
import os
import zipfile

import keras
import numpy as np
import pytest

import keras_mp
from tests.saving import STEPS_PER_EPOCH
from tests.saving import assert_same_state
from tests.saving import compiled
from tests.saving import data
from tests.saving import fit
from tests.saving import numpy
from tests.saving import policies
from tests.saving import state


# The cells whose saved state differs: float16 with a dynamic scale and
# float32 variables (O2), bfloat16 with a fixed scale, half variables and
# float32 master weights (O3); compensated updates below. O0 and O1 save as
# O2 does (Keras's policies, float32 variables). CI also runs them on the
# oldest Keras keras_mp supports (`-m floor`).
@pytest.mark.floor
@pytest.mark.parametrize(
    "level, dtype, loss_scale", [("O2", "float16", "dynamic"), ("O3", "bfloat16", 64.0)]
)
def test_keras_round_trip_and_exact_resume(tmp_path, level, dtype, loss_scale):
    _check_round_trip_and_exact_resume(tmp_path, compiled(level, dtype, loss_scale), level)


def test_compensated_updates_round_trip_and_resume_exactly(tmp_path):
    model = compiled("O3", "bfloat16", master_weights="compensated")
    _check_round_trip_and_exact_resume(tmp_path, model, "O3")
    buffers = [v for v in model.optimizer.variables if v.name.endswith("_compensation")]
    assert buffers and any(np.any(numpy(b) != 0) for b in buffers)


def _check_round_trip_and_exact_resume(tmp_path, model, level):
    fit(model, epochs=1)
    optimizer = model.optimizer
    assert int(numpy(optimizer.skipped_steps)) == 1  # the NaN batch
    assert int(numpy(optimizer.iterations)) == STEPS_PER_EPOCH - 1

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    # Everything came back.
    assert policies(loaded) == policies(model)
    assert type(loaded.optimizer) is keras_mp.LossScaleOptimizer
    assert loaded.optimizer.get_config() == optimizer.get_config()
    for name in ("loss_scale", "good_steps", "skipped_steps", "iterations"):
        np.testing.assert_array_equal(
            numpy(getattr(loaded.optimizer, name)), numpy(getattr(optimizer, name))
        )
    assert_same_state(state(loaded), state(model))
    assert loaded.get_compile_config() == model.get_compile_config()
    assert loaded.get_compile_config()["amp_level"] == level
    x, _ = data()
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))

    # Training resumes exactly: the original goes on without a save.
    fit(model, epochs=2)
    fit(loaded, epochs=2)
    assert int(numpy(loaded.optimizer.skipped_steps)) == 3
    assert_same_state(state(loaded), state(model))


@pytest.fixture(scope="module")
def uninterrupted():
    """The state after 3 epochs without a save, for the module: a resumed run
    ends there, bit for bit. The run moves the scale both ways (256, back
    off to 128, grow to 256, back off to 128): a non-trivial state."""
    reference = compiled()
    fit(reference, epochs=3)
    assert float(numpy(reference.optimizer.loss_scale)) == 128.0
    assert int(numpy(reference.optimizer.good_steps)) == 2
    assert int(numpy(reference.optimizer.skipped_steps)) == 3
    return state(reference)


def test_model_checkpoint_resumes_as_an_uninterrupted_run(tmp_path, uninterrupted):
    """N steps, a checkpoint (the full model, or its weights with the
    optimizer's), a new model object, M steps: N + M steps without a save."""
    model = compiled()
    full = keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.keras"))
    weights = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "epoch{epoch}.weights.h5"), save_weights_only=True
    )
    fit(model, epochs=1, callbacks=[full, weights])
    saved = state(model)
    del model  # nothing of it is left to share

    resumed = keras.models.load_model(str(tmp_path / "epoch1.keras"))
    assert int(numpy(resumed.optimizer.iterations)) == STEPS_PER_EPOCH - 1
    assert_same_state(state(resumed), saved)
    fit(resumed, epochs=3, initial_epoch=1)
    assert_same_state(state(resumed), uninterrupted)

    # A new process: the same code builds and compiles the model, then loads.
    resumed = compiled()
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(str(tmp_path / "epoch1.weights.h5"))
    assert_same_state(state(resumed), saved)
    assert float(numpy(resumed.optimizer.loss_scale)) == 128.0  # backed off, and came back
    fit(resumed, epochs=3, initial_epoch=1)
    assert_same_state(state(resumed), uninterrupted)


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("Interrupting training (simulated failure).")


def test_backup_and_restore_interrupted_mid_epoch(tmp_path, uninterrupted):
    backup_dir = str(tmp_path / "backup")
    model = compiled()
    with pytest.raises(RuntimeError, match="simulated failure"):
        fit(
            model,
            epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir), _Interrupt(1, 2)],
        )
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 1  # epoch 0 is backed up

    # A restarted job: a new model object, restored from the backup.
    restarted = compiled()
    fit(restarted, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])
    assert_same_state(state(restarted), uninterrupted)
    assert int(numpy(restarted.optimizer.skipped_steps)) == 3


@pytest.mark.one_backend  # Keras's archive and h5py readers, the same on every backend
@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_damaged_keras_file_raises(tmp_path, damage):
    model = compiled()
    path = str(tmp_path / "model.keras")
    model.save(path)
    with open(path, "rb") as f:
        data = f.read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        # Garble the weights inside the archive, keep the zip's directory.
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo("model.weights.h5")
        start = info.header_offset + 30 + len(info.filename) + 64
        data = data[:start] + b"\x00" * 256 + data[start + 256 :]
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(Exception) as error:
        keras.models.load_model(path)
    message = str(error.value).lower()
    # The archive's reader or h5py's (whose wording changes between versions,
    # e.g. "ring type mismatch" in newer ones) says what broke.
    assert any(
        word in message for word in ("zip", "crc", "file", "truncat", "h5", "mismatch", "unable to")
    ), message
