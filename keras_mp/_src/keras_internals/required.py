"""The Keras releases keras_mp supports, and `_need`: a Keras internal that
a release lacks fails `import keras_mp` with the Keras version and its
name, not an `AttributeError` deep in a step."""

import importlib

import keras

# The Keras releases keras_mp is tested with: the whole suite on the newest,
# the smoke tests (`-m floor`) on the oldest, which pyproject.toml requires.
TESTED = "3.15"

OLDEST = (3, 10)


class KerasInternalsError(ImportError):
    """A Keras internal that keras_mp needs is missing in this Keras."""


class KerasTooOldError(ImportError):
    """The installed Keras is older than the oldest keras_mp supports."""


def _release(version):
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_keras_version(version=None):
    """Fails here, at import, on a Keras older than `OLDEST` (not later, in
    `fit`, where an older Keras lacks what a step uses)."""
    version = keras.__version__ if version is None else version
    if _release(version) < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        raise KerasTooOldError(
            f"keras_mp needs Keras {oldest} or newer (tested with {oldest} and "
            f"{TESTED}); this environment has Keras {version}. Upgrade it: "
            f"`pip install -U 'keras>={oldest}'`."
        )


check_keras_version()


def _need(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise KerasInternalsError(
            f"keras_mp needs `{module}.{name}` from Keras's internals, which "
            f"Keras {keras.__version__} does not have (keras_mp is tested with "
            f"Keras {TESTED}). Install a Keras release keras_mp supports "
            f"(`pip install 'keras=={TESTED}.*'`), or a keras_mp release made "
            f"for Keras {keras.__version__}."
        ) from error
