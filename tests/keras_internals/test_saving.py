"""Where Keras saves, clones and restores: the functions keras_mp extends
are there, and BackupAndRestore's files and position are read as Keras
keeps them."""

import keras
import pytest

from keras_mp._src import keras_internals

# Keras's generic internals: the same whichever backend runs.
pytestmark = pytest.mark.one_backend


def test_the_saving_internals_are_there():
    for name in ("get_input_signature", "is_remote_path", "BackupAndRestore", "Layer"):
        assert getattr(keras_internals, name) is not None, name
    for name in keras_internals.CLONES:
        assert callable(getattr(keras_internals.cloning, name))
    assert callable(keras_internals.saving_lib.save_model)
    assert callable(getattr(keras_internals.Layer, keras_internals.POST_BUILD))
    assert not keras_internals.is_remote_path("/tmp/model.keras")


def test_backup_and_restore_s_files_and_position(tmp_path):
    callback = keras.callbacks.BackupAndRestore(str(tmp_path))
    weights, metadata, *_ = keras_internals.backup_files(callback)
    assert str(weights).startswith(str(tmp_path)) and str(metadata).startswith(str(tmp_path))
    callback._current_epoch, callback._last_batch_seen = 3, 7
    assert keras_internals.backup_position(callback) == {"epoch": 3, "batch": 7}
