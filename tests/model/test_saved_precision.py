"""Each layer's precision through a `.keras` file (`saved_precision.py`):
every model kind, a model with its own `compile`, and whatever set the
precision (a level, `allow=`/`deny=`, `to_float`, `apply_amp`) comes back
exactly, with its weights, and training resumes exactly; a file of an
earlier release (the record in its compile config only) too."""

import json
import warnings
import zipfile

import keras
import numpy as np
import pytest

from tests.saving import HOW_SET
from tests.saving import assert_same_state
from tests.saving import classifier
from tests.saving import compiled
from tests.saving import data
from tests.saving import fit
from tests.saving import numpy
from tests.saving import policies
from tests.saving import precision
from tests.saving import state
from tests.saving import to_float_after_compile
from tests.saving import with_block


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class SubclassedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.out = keras.layers.Dense(3, activation="softmax", name="out")

    def call(self, x):
        return self.out(self.norm(self.hidden(x)))


def _normalization_first():
    """`keras.layers.Normalization` first, adapted: its statistics are set,
    not trained, and converted to its compute dtype when it is built."""
    x, _ = data()
    norm = keras.layers.Normalization(name="normalization")
    norm.adapt(np.nan_to_num(x) * 50.0 + 300.0)  # statistics far from 0 and 1
    return keras.Sequential(
        [
            keras.Input((6,)),
            norm,
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


# Normalization's adapted statistics in float32 among half layers (O3, with
# BatchNorm kept float32), and a subclassed model's layers by attribute (O2).
@pytest.mark.parametrize(
    "kind, level",
    [("normalization_first", "O3"), ("subclassed", "O2")],
    ids=["normalization_first-O3", "subclassed-O2"],
)
def test_every_model_kind_keeps_its_precision_through_a_keras_file(tmp_path, kind, level):
    keras.utils.set_random_seed(0)
    model = _normalization_first() if kind == "normalization_first" else SubclassedNet(name="net")
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        keep_batchnorm_fp32=True if level == "O3" else None,
    )
    x, _ = data()
    x = np.nan_to_num(x) * 50.0 + 300.0 if kind == "normalization_first" else np.nan_to_num(x)
    before = model.predict(x, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert policies(loaded) == policies(model)
    assert [v.dtype for v in loaded.weights] == [v.dtype for v in model.weights]
    if kind == "normalization_first":
        norm = loaded.get_layer("normalization")
        assert norm.dtype_policy.name == "float32"
        assert {
            keras.backend.standardize_dtype(norm.mean.dtype),
            keras.backend.standardize_dtype(norm.variance.dtype),
        } == {"float32"}
    after = loaded.predict(x, verbose=0)
    assert after.dtype == np.float32
    np.testing.assert_array_equal(after, before)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class OwnCompile(keras.Model):
    """Overrides `compile` and passes Keras's arguments on (KerasHub's tasks
    do, with defaults their constructor compiles with)."""

    def compile(self, optimizer="sgd", loss="sparse_categorical_crossentropy", **kwargs):
        super().compile(optimizer=optimizer, loss=loss, **kwargs)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class TwoOptimizers(keras.Model):
    """A GAN's `compile`: arguments Keras's saved config cannot fill."""

    def compile(self, d_optimizer, g_optimizer, **kwargs):
        self.g_optimizer = g_optimizer
        super().compile(optimizer=d_optimizer, **kwargs)


@pytest.mark.parametrize("cls", [OwnCompile, TwoOptimizers], ids=["passes_on", "two_optimizers"])
def test_a_model_with_its_own_compile_comes_back_with_what_it_can(tmp_path, cls):
    """Keras does not call a `compile` the class overrides when it loads the
    model. One that takes the saved arguments is called with them, so the
    optimizer's state (the loss scale with it) is loaded; one that cannot is
    left to Keras's warning, and the precision still comes back."""
    reference = compiled()
    model = cls(reference.inputs, reference.outputs)
    arguments = dict(loss="sparse_categorical_crossentropy", amp_level="O2")
    if cls is OwnCompile:
        model.compile(optimizer=reference.optimizer, **arguments)
        fit(model, epochs=1)  # the NaN batch backs the scale off
    else:
        model.compile(reference.optimizer, keras.optimizers.SGD(), **arguments)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(path)
    skipped_compile = any(
        "was not called as part of model loading" in str(w.message) for w in caught
    )
    assert policies(loaded) == policies(model)
    if cls is OwnCompile:
        assert not skipped_compile
        assert loaded.get_compile_config()["amp_level"] == "O2"
        assert_same_state(state(loaded), state(model))
        assert float(numpy(loaded.optimizer.loss_scale)) != 2.0**8  # it moved, and came back
    else:
        assert skipped_compile and getattr(loaded, "optimizer", None) is None


# Which precision each layer's record gives back is decided before any
# backend computes: each way of setting it once; a block at O3 (half
# variables, the block's sublayers and `x + dense(x)` in half) on each.
@pytest.mark.parametrize(
    "how", [pytest.param(how, marks=[pytest.mark.one_backend] * (how != "O3")) for how in HOW_SET]
)
def test_the_precision_you_set_comes_back_exactly(tmp_path, how):
    """Whatever set each layer's precision (a level, `allow=`/`deny=`, a
    `to_float` after `compile`, `apply_amp` with a plain `compile`), in a
    model with a block of your own: `load_model` gives every layer back its
    policy, rule and weights' dtype, and training resumes exactly."""
    build, set_precision = HOW_SET[how]
    model = build()
    set_precision(model)
    x, y = data()
    fit(model, epochs=1)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    assert precision(loaded) == precision(model)
    assert [v.dtype for v in loaded.weights] == [v.dtype for v in model.weights]
    assert_same_state(state(loaded), state(model))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    fit(model, epochs=2, initial_epoch=1)
    fit(loaded, epochs=2, initial_epoch=1)
    assert_same_state(state(loaded), state(model))
    # A later compile at a level keeps what `allow=`/`deny=` chose.
    if how == "subclassed-deny-by-class":
        loaded.compile("adam", "sparse_categorical_crossentropy", amp_level="O2")
        assert {r[1] for r in precision(loaded) if r[0] == "Dense"} == {"float32"}


@pytest.mark.one_backend
def test_saved_precision_for_another_model_is_not_applied():
    """`compile_from_config` given the config of a model with other layers
    applies the level, and says that the saved per-layer precision does not
    fit this model."""
    model = with_block()
    to_float_after_compile(model)
    other = classifier()
    with pytest.warns(UserWarning, match="per-layer precision.*does not match"):
        other.compile_from_config(model.get_compile_config())
    assert other.get_layer("hidden").dtype_policy.name == "mixed_float16"
    assert other.get_compile_config()["amp_level"] == "O2"


def _as_earlier_releases_wrote(path):
    """Rewrites a `.keras` file as releases before the record in the model's
    own config wrote it: each model's `dtype` its policy's name (none in a
    functional model's config), the record in the compile config only."""

    def strip(config):
        if isinstance(config, list):
            return [strip(c) for c in config]
        if not isinstance(config, dict):
            return config
        dtype = config.get("dtype")
        if isinstance(dtype, dict) and "layers" in (dtype.get("config") or {}):
            config = dict(config)
            if "input_layers" in config:
                del config["dtype"]
            else:
                name = dtype["config"]["name"]
                config["dtype"] = {
                    "module": "keras",
                    "class_name": "DTypePolicy",
                    "config": {"name": name},
                    "registered_name": None,
                }
        return {k: strip(v) for k, v in config.items()}

    with zipfile.ZipFile(path) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    files["config.json"] = json.dumps(strip(json.loads(files["config.json"]))).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)


@pytest.mark.one_backend  # a config read: the record in the compile config
@pytest.mark.parametrize("how", ["to_float-after-compile", "subclassed-deny-by-class"])
def test_a_file_of_an_earlier_release_still_loads_exactly(tmp_path, how):
    """Its compile config alone gives each layer back its precision, with
    `compile=False` too."""
    build, set_precision = HOW_SET[how]
    model = build()
    set_precision(model)
    x, _ = data()
    x = np.nan_to_num(x)
    model(x[:1])
    path = str(tmp_path / "model.keras")
    model.save(path)
    _as_earlier_releases_wrote(path)
    with zipfile.ZipFile(path) as archive:
        assert b'"layers": [{"class"' not in archive.read("config.json")
    for compile in (True, False):
        loaded = keras.models.load_model(path, compile=compile)
        assert precision(loaded) == precision(model)
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
