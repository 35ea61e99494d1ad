"""A save never loses the last good file: written beside it, then renamed.

Keras opens a `.keras` file and a `.weights.h5` file with `"wb"` and writes
them in place, and BackupAndRestore its `training_metadata.json` too: the
previous file is gone from the first byte, and a process killed while it
writes (a preempted job, an out-of-memory kill) leaves a truncated file,
which does not load, and no other. Here each is written to a file of its
own in the same folder, flushed to the disk (`fsync`), and renamed over the
target (`os.replace`, atomic on POSIX and Windows): at any moment the
target is the previous file or the new one, whole. A save that raises
leaves the target untouched and no file of its own behind.

What else stays as Keras has it: a file written for the first time gets
the mode Keras's `open` would give it (the umask's), one written over keeps
the mode it had, and a symbolic link stays a link to a file replaced in its
own folder. Remote paths (`gs://`, `hf://`), file objects, unzipped
folders and sharded weights are written by Keras as before.

Installed for every model once keras_mp is imported (`install`): it
changes where the bytes go first, nothing in them.
"""

import contextlib
import functools
import inspect
import json
import os
import secrets
import shutil

from keras_mp._src import keras_internals

saving_lib = keras_internals.saving_lib
_keras_save_model = saving_lib.save_model
_keras_save_weights_only = saving_lib.save_weights_only
_keras_backup_save = getattr(keras_internals.BackupAndRestore, keras_internals.BACKUP_SAVE)

# The endings Keras checks a file name for: the temporary file keeps them.
_ENDINGS = (".weights.h5", ".keras", ".json", ".h5")


def _argument(function, name, args, kwargs):
    """The value Keras's `function` gets for its argument `name`."""
    bound = inspect.signature(function).bind_partial(None, None, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments.get(name)


def _local_file(filepath):
    """Whether `filepath` names a file on this machine's disk."""
    if not isinstance(filepath, (str, os.PathLike)):
        return False  # a file object: the caller owns it
    return not keras_internals.is_remote_path(str(filepath))


@contextlib.contextmanager
def replacing(filepath):
    """Yields a path beside `filepath` to write the new file to; when the
    block ends without an error, the file written there is flushed to the
    disk and renamed over `filepath`. On an error it is removed and
    `filepath` is left as it was."""
    target = os.path.realpath(os.fspath(filepath))
    folder, name = os.path.split(target)
    ending = next((e for e in _ENDINGS if name.endswith(e)), "")
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp{ending}")
    try:
        yield temporary
        _flush(temporary)
        if os.path.exists(target):
            shutil.copymode(target, temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _flush_folder(folder)


def _flush(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _flush_folder(folder):
    """Makes the rename itself durable (POSIX; elsewhere a folder cannot be
    opened, and the rename is as durable as the system makes it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@functools.wraps(_keras_save_model)
def save_model(model, filepath, *args, **kwargs):
    """Keras's `saving_lib.save_model` (`model.save`, `keras.saving.save_model`,
    `ModelCheckpoint`): a zipped `.keras` file on disk is written beside and
    renamed."""
    zipped = _argument(_keras_save_model, "zipped", args, kwargs)
    if not (zipped and _local_file(filepath) and str(filepath).endswith(".keras")):
        return _keras_save_model(model, filepath, *args, **kwargs)
    with replacing(filepath) as temporary:
        return _keras_save_model(model, temporary, *args, **kwargs)


@functools.wraps(_keras_save_weights_only)
def save_weights_only(model, filepath, *args, **kwargs):
    """Keras's `saving_lib.save_weights_only` (`model.save_weights`,
    `ModelCheckpoint(save_weights_only=True)`, `BackupAndRestore`): a
    `.weights.h5` file on disk is written beside and renamed."""
    sharded = _argument(_keras_save_weights_only, "max_shard_size", args, kwargs) is not None
    if sharded or not (_local_file(filepath) and str(filepath).endswith(".weights.h5")):
        return _keras_save_weights_only(model, filepath, *args, **kwargs)
    with replacing(filepath) as temporary:
        return _keras_save_weights_only(model, temporary, *args, **kwargs)


@functools.wraps(_keras_backup_save)
def save_backup(self, *args, **kwargs):
    """BackupAndRestore's save, as Keras's does it, each file replaced whole:
    with `double_checkpoint` the previous files copied aside, then the
    weights (`save_weights_only`), then the epoch and batch they are of."""
    weights, metadata, previous_weights, previous_metadata = keras_internals.backup_files(self)
    if not all(_local_file(path) for path in (weights, metadata)):
        return _keras_backup_save(self, *args, **kwargs)
    os.makedirs(self.backup_dir, exist_ok=True)
    if getattr(self, "double_checkpoint", False):
        for source, copy in ((weights, previous_weights), (metadata, previous_metadata)):
            if copy is not None and os.path.exists(source):
                with replacing(copy) as temporary:
                    shutil.copy(source, temporary)
    self.model.save_weights(filepath=weights, overwrite=True)
    with replacing(metadata) as temporary:
        with open(temporary, "w") as f:
            f.write(json.dumps(keras_internals.backup_position(self)))


def install():
    """Installs the three (idempotent)."""
    saving_lib.save_model = save_model
    saving_lib.save_weights_only = save_weights_only
    setattr(keras_internals.BackupAndRestore, keras_internals.BACKUP_SAVE, save_backup)
