"""Where Keras saves, loads, clones and exports: the functions keras_mp
extends so that every road back keeps a model's precision and a save never
loses the last good file."""

import importlib

from keras_mp._src.keras_internals.required import _need

get_input_signature = _need("keras.src.export.export_utils", "get_input_signature")

# `load_model`'s reading of a `.keras` file's config: keras_mp gives a model
# loaded with `compile=False` the precision its compile config recorded.
saving_lib = importlib.import_module("keras.src.saving.saving_lib")

_need("keras.src.saving.saving_lib", "_model_from_config")

# How Keras rebuilds a model other than from its config: `clone_model` of a
# Sequential or functional model clones its layers one by one
# (`config_precision.py` gives the clone the precision of the model).
cloning = importlib.import_module("keras.src.models.cloning")

_need("keras.src.models.cloning", "_clone_functional_model")

_need("keras.src.models.cloning", "_clone_sequential_model")

CLONES = ("_clone_functional_model", "_clone_sequential_model")

# The base class of every layer, and the method its `build` ends with (also
# where `build` is not overridden, at its construction): a rebuilt model is
# given back the precision its config recorded once it is built.
Layer = _need("keras.src.layers.layer", "Layer")

POST_BUILD = "_post_build"

if not callable(getattr(Layer, POST_BUILD, None)):
    _need("keras.src.layers.layer", f"Layer.{POST_BUILD}")

# Where Keras writes a `.keras` file, a `.weights.h5` file and
# BackupAndRestore's files, each in place (`atomic_save.py` has them
# written beside and renamed).
_need("keras.src.saving.saving_lib", "save_model")

_need("keras.src.saving.saving_lib", "save_weights_only")

is_remote_path = _need("keras.src.utils.file_utils", "is_remote_path")

BackupAndRestore = _need("keras.src.callbacks.backup_and_restore", "BackupAndRestore")

# The method that writes BackupAndRestore's files (it is replaced whole).
BACKUP_SAVE = "_save_model"

if not callable(getattr(BackupAndRestore, BACKUP_SAVE, None)):
    _need("keras.src.callbacks.backup_and_restore", f"BackupAndRestore.{BACKUP_SAVE}")


def backup_files(callback):
    """BackupAndRestore's files: `(weights, metadata, previous weights,
    previous metadata)`, the previous ones written with `double_checkpoint`."""
    return (
        callback._weights_path,
        callback._training_metadata_path,
        getattr(callback, "_prev_weights_path", None),  # Keras 3.11 and newer
        getattr(callback, "_prev_training_metadata_path", None),
    )


def backup_position(callback):
    """What BackupAndRestore records beside the weights: the epoch and the
    batch it saved at."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}
