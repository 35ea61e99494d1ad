"""The Keras releases keras_mp supports: a Keras older than the floor is
refused at import, and an internal a release lacks is named with the
version."""

import subprocess
import sys

import keras
import pytest

from keras_mp._src import keras_internals

# Which Keras releases are taken: the same whichever backend runs.
pytestmark = pytest.mark.one_backend


def test_a_missing_internal_names_the_keras_version_and_itself():
    with pytest.raises(keras_internals.KerasInternalsError) as info:
        keras_internals._need("keras.src.trainers.trainer", "NoSuchThing")
    message = str(info.value)
    assert "keras.src.trainers.trainer.NoSuchThing" in message
    assert f"Keras {keras.__version__}" in message and keras_internals.TESTED in message
    with pytest.raises(ImportError, match="keras.src.nowhere.Thing"):
        keras_internals._need("keras.src.nowhere", "Thing")


@pytest.mark.parametrize("version", ["3.9.2", "3.8.0", "3.0.0", "2.15.0"])
def test_a_keras_older_than_the_floor_is_refused_by_name(version):
    with pytest.raises(keras_internals.KerasTooOldError) as raised:
        keras_internals.check_keras_version(version)
    message = str(raised.value)
    assert f"this environment has Keras {version}" in message
    assert "keras_mp needs Keras 3.10 or newer" in message
    assert "pip install -U 'keras>=3.10'" in message


@pytest.mark.parametrize("version", ["3.10.0", "3.10.1.dev2025", "3.15.1", "3.16.0rc1"])
def test_the_floor_and_newer_are_taken(version):
    keras_internals.check_keras_version(version)


def test_an_old_keras_fails_at_import_not_later():
    """Where the installed Keras says it is older than the floor, `import
    keras_mp` raises, before anything else of it runs: in a fresh
    interpreter whose `keras` is a module with nothing but a version, any
    other use of Keras would fail otherwise (and importing the real Keras
    there took 20-40 s of the suite)."""
    code = (
        "import sys, types; keras = types.ModuleType('keras'); "
        "keras.__version__ = '3.9.2'; sys.modules['keras'] = keras; import keras_mp"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "KerasTooOldError: keras_mp needs Keras 3.10 or newer" in result.stderr
