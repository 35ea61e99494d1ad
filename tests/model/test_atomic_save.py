"""A save never loses the last good file (`atomic_save.py`): a process
killed while `model.save`, `ModelCheckpoint` or `BackupAndRestore` writes
leaves the previous file or the new one; a save that raises leaves the
previous file; a save that succeeds leaves nothing else beside it."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_mp  # noqa: F401 (installs the atomic writes)
from tests import processes

# The files are written by Keras's saving code, the same on every backend.
pytestmark = pytest.mark.one_backend

# Imports keras_mp once and saves a model once (a first `.keras` save imports
# TensorFlow's file system, 7 s), then for each trial forks a writer that
# saves over its target until killed, a random moment after its first good
# save; then loads what each left. One thread per process: no OpenMP pool
# that a fork could copy mid-task.
_TRIALS = """
import json, os, random, signal, sys, time
import numpy as np
import keras
import keras_mp

def model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32), keras.layers.Dense(2)])

def write(how, target, ready):
    m = model()
    m.compile("sgd", "mse", amp_level="O2")
    x, y = np.ones((64, 8), "float32"), np.ones((64, 2), "float32")
    if how == "save":
        m.save(target)
        os.write(ready, b"r")
        while True:
            m.save(target)
    callback = {
        "checkpoint": lambda: keras.callbacks.ModelCheckpoint(target, save_freq=1),
        "weights": lambda: keras.callbacks.ModelCheckpoint(
            target, save_weights_only=True, save_freq=1
        ),
        "backup": lambda: keras.callbacks.BackupAndRestore(
            target, save_freq=1, delete_checkpoint=False
        ),
    }[how]()
    m.fit(x, y, batch_size=32, epochs=1, callbacks=[callback], verbose=0)
    os.write(ready, b"r")
    m.fit(x, y, batch_size=1, epochs=10**6, callbacks=[callback], verbose=0)

def loads(how, target):
    m = model()
    try:
        if how in ("save", "checkpoint"):
            keras.models.load_model(target)
        elif how == "weights":
            m.load_weights(target)
        else:
            m.load_weights(os.path.join(target, "latest.weights.h5"))
            with open(os.path.join(target, "training_metadata.json")) as f:
                json.loads(f.read())
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:300]
    return None

folder, trials = sys.argv[1], sys.argv[2:]
model().save(os.path.join(folder, "first.keras"))
rng = random.Random(0)
targets = []
for i, how in enumerate(trials):
    name = {"save": "m.keras", "checkpoint": "m.keras", "weights": "m.weights.h5"}.get(how, "b")
    target = os.path.join(folder, f"{i}_{name}")
    targets.append(target)
    read, ready = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            write(how, target, ready)
        finally:
            os._exit(1)
    os.close(ready)
    if os.read(read, 1) != b"r":
        sys.exit(f"the {how} writer failed before its first save")
    time.sleep(rng.uniform(0.02, 0.3))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
print(json.dumps({f"{i} {how}": loads(how, t) for i, (how, t) in enumerate(zip(trials, targets))}))
"""


@pytest.mark.slow(reason="five writer processes, each killed at a random moment, then loaded")
def test_a_writer_killed_at_any_moment_leaves_a_file_that_loads(tmp_path):
    """Five writers (two `model.save` loops, `ModelCheckpoint` of the model and
    of its weights, `BackupAndRestore`, each saving at every batch) killed
    with SIGKILL a random moment after their first good save. Keras's own
    writes in place left a truncated file in about half the trials."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRIALS,
            str(tmp_path),
            "save",
            "checkpoint",
            "weights",
            "backup",
            "save",
        ],
        env=dict(processes.env_for(keras.backend.backend()), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    broken = json.loads(result.stdout.strip().splitlines()[-1])
    assert not any(broken.values()), broken


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_a_save_leaves_only_its_file_with_the_mode_it_had(tmp_path):
    model = _model()
    for name, save in (("m.keras", model.save), ("m.weights.h5", model.save_weights)):
        path = tmp_path / name
        save(str(path))
        os.chmod(path, 0o640)
        save(str(path))
        assert sorted(os.listdir(tmp_path))[-1] == name
        assert os.stat(path).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]
    link = tmp_path / "link.keras"
    os.symlink(tmp_path / "m.keras", link)
    model.save(str(link))
    assert os.path.islink(link)
    assert sorted(os.listdir(tmp_path)) == ["link.keras", "m.keras", "m.weights.h5"]


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _FailsToSave(keras.layers.Dense):
    """A layer whose state cannot be written once `fail` is set (a full disk
    half-way, a layer of your own that raises)."""

    fail = False

    def save_own_variables(self, store):
        if _FailsToSave.fail:
            raise OSError("No space left on device")
        super().save_own_variables(store)


def test_a_save_that_raises_leaves_the_previous_file(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), _FailsToSave(2)])
    x = np.ones((2, 3), "float32")
    for name, save in (("m.keras", model.save), ("m.weights.h5", model.save_weights)):
        path = tmp_path / name
        save(str(path))
        before = path.read_bytes()
        _FailsToSave.fail = True
        try:
            with pytest.raises(OSError, match="No space left"):
                save(str(path))
        finally:
            _FailsToSave.fail = False
        assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
