"""`compile(amp_level=...)`: the keyword, the function, saving, bad input."""

import inspect
import re

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.model import compile as amp_compile
from keras_mp._src.model import saved_precision
from tests import models

BACKEND = keras.backend.backend()


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _model():
    return models.dense_bn_classifier()


def _data():
    return models.three_class_data(32)


@pytest.mark.one_backend
def test_plain_compile_is_unchanged():
    from keras.src.trainers.trainer import Trainer

    model = _model()
    optimizer = keras.optimizers.Adam()
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer
    config = model.get_compile_config()
    assert not set(saved_precision.AMP_ARGUMENTS + (saved_precision.AMP_LAYERS,)) & set(config)
    assert model.get_layer("hidden").dtype_policy.name == "float32"
    # Keras still sees `compile` as its own (so load_model recompiles).
    assert type(model).compile == Trainer.compile
    parameters = inspect.signature(amp_compile._keras_compile).parameters
    assert "auto_scale_loss" in parameters and "amp_level" not in parameters


@pytest.mark.one_backend
def test_compile_with_an_explicit_loss_scale_optimizer():
    model = _model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", amp_level="O2")
    assert model.optimizer is optimizer
    assert model.get_layer("hidden").dtype_policy.name == "mixed_float16"
    assert model.get_layer("bn").dtype_policy.name == "float32"
    assert model.get_layer("out").dtype_policy.name == "mixed_float16"  # returns float32
    x, y = _data()
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    out = model.predict(x, verbose=0)
    assert out.dtype == np.float32


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "kwargs, wrapped, dynamic, scale",
    [
        ({"amp_level": "O2"}, True, True, 2.0**15),
        ({"amp_level": "O1"}, True, True, 2.0**15),
        # bfloat16: no loss scale, but each step is checked and a
        # non-finite one skipped (a fixed scale of 1).
        ({"amp_level": "O2", "amp_dtype": "bfloat16"}, True, False, 1.0),
        ({"amp_level": "O2", "amp_dtype": "bfloat16", "loss_scale": None}, False, None, None),
        # O3's half variables get float32 master weights, in a wrapper of
        # their own where no loss scale is asked for.
        ({"amp_level": "O3"}, True, False, 1.0),
        ({"amp_level": "O3", "amp_dtype": "bfloat16"}, True, False, 1.0),
        ({"amp_level": "O3", "master_weights": False}, False, None, None),
        ({"amp_level": "O2", "master_weights": False}, True, True, 2.0**15),
        ({"amp_level": "O0"}, False, None, None),
        ({"amp_level": "O2", "loss_scale": 1024}, True, False, 1024.0),
        ({"amp_level": "O2", "loss_scale": None}, False, None, None),
        ({"amp_level": "O3", "loss_scale": "dynamic"}, True, True, 2.0**15),
    ],
)
def test_optimizer_is_wrapped_when_the_level_calls_for_it(kwargs, wrapped, dynamic, scale):
    model = _model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    is_lso = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert is_lso is wrapped
    if wrapped:
        assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
        assert not isinstance(model.optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer)
        assert model.optimizer.dynamic is dynamic
        assert model.optimizer.initial_scale == scale
        assert model.optimizer.master_weights is kwargs.get("master_weights", True)


@pytest.mark.one_backend
def test_never_wrapped_twice_under_a_global_mixed_policy():
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    model.compile(optimizer="sgd", loss="mse", amp_level="O2")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert not isinstance(model.optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer)


class SubclassedClassifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))


def _of_kind(kind):
    return _model() if kind == "functional" else SubclassedClassifier()


@pytest.mark.one_backend
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_a_plain_compile_scales_the_loss_of_float16_layers_as_keras_does(kind):
    """Keras wraps the optimizer in a LossScaleOptimizer when the model's
    policy is mixed_float16 (`auto_scale_loss`). After `apply_amp(model,
    "O2")` the layers compute in float16 whatever the model's own policy (a
    subclassed model's is float32, for float32 inputs and outputs, so Keras
    did not wrap: its float16 gradients went unscaled): a `compile` without
    `amp_level` wraps the optimizer as under Keras's global mixed_float16,
    for every kind of model; not with `auto_scale_loss=False`. In bfloat16 it
    is wrapped in a fixed scale of 1, which skips a non-finite step (Keras's
    mixed_bfloat16 leaves the optimizer bare: a NaN batch poisons every
    weight)."""
    keras.config.set_dtype_policy("mixed_float16")
    reference = _of_kind(kind)
    reference.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert isinstance(reference.optimizer, keras.optimizers.LossScaleOptimizer)
    keras.config.set_dtype_policy("float32")

    model = keras_mp.apply_amp(_of_kind(kind), "O2")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.dynamic and isinstance(
        model.optimizer.inner_optimizer, keras.optimizers.Adam
    )
    x, y = _data()
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert 0 < history.history["loss_scale"][0] <= 2.0**15  # the dynamic scale

    unscaled = keras_mp.apply_amp(_of_kind(kind), "O2")
    unscaled.compile(optimizer="adam", loss="mse", auto_scale_loss=False)
    assert not isinstance(unscaled.optimizer, keras.optimizers.LossScaleOptimizer)
    bfloat16 = keras_mp.apply_amp(_of_kind(kind), "O2", "bfloat16")
    bfloat16.compile(optimizer="adam", loss="mse")
    assert isinstance(bfloat16.optimizer, keras_mp.LossScaleOptimizer)
    assert not bfloat16.optimizer.dynamic and bfloat16.optimizer.initial_scale == 1.0
    assert bfloat16.optimizer.config.checks_finite


@pytest.mark.one_backend
def test_function_form():
    model = _model()
    keras_mp.compile(model, "adam", "mse", amp_level="O1", amp_dtype="bfloat16")
    assert model.get_layer("hidden").dtype_policy.name == "mixed_bfloat16"
    assert model.get_layer("bn").dtype_policy.name == "float32"
    with pytest.raises(TypeError, match="`model` must be a `keras.Model`.*Received: model="):
        keras_mp.compile(keras.layers.Dense(2), "adam", amp_level="O1")


def test_amp_settings_travel_with_the_saved_model(tmp_path):
    model = _model()
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", amp_level="O2", loss_scale=512
    )
    config = model.get_compile_config()
    assert config["amp_level"] == "O2" and config["amp_dtype"] == "float16"
    assert config["loss_scale"] == 512
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    path = str(tmp_path / "amp.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_compile_config()["amp_level"] == "O2"
    assert isinstance(loaded.optimizer, keras_mp.LossScaleOptimizer)
    assert not isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer)
    assert loaded.optimizer.dynamic is False and loaded.optimizer.initial_scale == 512.0
    for layer, original in zip(loaded.layers, model.layers):
        assert layer.dtype_policy.name == original.dtype_policy.name
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.fit(x, y, epochs=1, batch_size=8, verbose=0)


LAYER_LISTS = {
    # O2 would compute "hidden" in float16; O1 would keep "bn" float32.
    "O2-deny-by-name": ("O2", {"deny": ["hidden"]}, "hidden", "float32"),
    "O1-allow-by-class": (
        "O1",
        {"allow": [keras.layers.BatchNormalization]},
        "bn",
        "mixed_float16",
    ),
    "O2-deny-a-layer": (
        "O2",
        {"deny": lambda model: [model.get_layer("hidden")]},
        "hidden",
        "float32",
    ),
}


@pytest.mark.one_backend
@pytest.mark.parametrize("how", ["apply_amp_first", "compile_keywords"])
@pytest.mark.parametrize("case", list(LAYER_LISTS))
def test_layers_you_allow_or_deny_keep_their_dtype_under_compile_and_after_loading(
    case, how, tmp_path
):
    """`apply_amp(model, level, allow=..., deny=...)`, then
    `compile(amp_level=...)`, which applies the level again: the layers keep
    the user's lists (they were dropped before); so does
    `compile(amp_allow=..., amp_deny=...)`, and the model `load_model` gives
    back, also when compiled at a level again."""
    level, lists, name, policy = LAYER_LISTS[case]
    model = _model()
    lists = {key: value(model) if callable(value) else value for key, value in lists.items()}
    if how == "apply_amp_first":
        keras_mp.apply_amp(model, level, **lists)
        amp = {}
    else:
        amp = {f"amp_{key}": value for key, value in lists.items()}
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", amp_level=level, **amp)
    assert model.get_layer(name).dtype_policy.name == policy
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    path = str(tmp_path / "lists.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    for layer in model.layers:
        assert loaded.get_layer(layer.name).dtype_policy.name == layer.dtype_policy.name
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    loaded.compile(optimizer="adam", loss="sparse_categorical_crossentropy", amp_level=level)
    assert loaded.get_layer(name).dtype_policy.name == policy
    # A later `apply_amp` without them clears them.
    keras_mp.apply_amp(model, level)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", amp_level=level)
    assert model.get_layer(name).dtype_policy.name != policy


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (
            {"amp_level": "O5"},
            ValueError,
            "must be one of O0, O1, O2, O3 or 'auto'. Received: amp_level='O5'",
        ),
        ({"amp_level": 2}, ValueError, "Received: amp_level=2"),
        ({"amp_level": "O2", "amp_dtype": "float64"}, ValueError, "amp_dtype='float64'"),
        ({"amp_level": "O2", "loss_scale": -1}, ValueError, "loss_scale=-1"),
        ({"amp_level": "O2", "loss_scale": "static"}, ValueError, "loss_scale='static'"),
        (
            {"amp_level": "O2", "loss_scale": 2.0**127},
            ValueError,
            "at most 2**126 (a fixed scale), or None. Received: loss_scale=1.7",
        ),
        ({"amp_level": "O2", "keep_batchnorm_fp32": "x"}, TypeError, "keep_batchnorm_fp32='x'"),
        ({"amp_dtype": "bfloat16"}, ValueError, "need `amp_level`"),
        ({"amp_deny": ["bn"]}, ValueError, "amp_deny=['bn']"),
        ({"amp_level": "O2", "amp_deny": 3}, TypeError, "Received: amp_deny=3"),
        ({"amp_level": "O1", "amp_allow": [len]}, TypeError, "layer names (strings)"),
    ],
)
def test_bad_amp_arguments(kwargs, error, fragment):
    with pytest.raises(error) as info:
        _model().compile(optimizer="adam", loss="mse", **kwargs)
    assert fragment in str(info.value)


def test_auto_says_what_it_picked(capsys):
    model = _model()
    model.compile(optimizer="adam", loss="mse", amp_level="auto")
    printed = capsys.readouterr().out
    level = model.get_compile_config()["amp_level"]
    assert level in keras_mp.LEVELS
    if level == "O0":
        assert "amp_level='auto' picked O0 (float32 everywhere): " in printed
        # Its reason may name bfloat16 (what it timed), never float16.
        assert not re.search(r"\bfloat16\b", printed) and "amp_level='O2'" in printed
    else:
        dtype = model.get_compile_config()["amp_dtype"]
        assert f"amp_level='auto' picked {level} in {dtype}: " in printed


def _bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )


def _bad_batch():
    x, y = _data()
    x_bad = x[:8].copy()
    x_bad[2, 1] = np.nan
    return x[:8], y[:8], x_bad


# The guard is each backend's own step (stateful or stateless): O2 on each.
# Which optimizer a level gets (checking every step in bfloat16 too) is a
# decision (`test_optimizer_is_wrapped_when_the_level_calls_for_it`).
@pytest.mark.parametrize(
    "amp",
    [
        pytest.param({"amp_level": "O1"}, marks=pytest.mark.one_backend),
        {"amp_level": "O2"},
        # bfloat16 needs no loss scale; a fixed scale of 1 still checks every step.
        pytest.param(
            {"amp_level": "O2", "amp_dtype": "bfloat16", "loss_scale": 1},
            marks=pytest.mark.one_backend,
        ),
    ],
    ids=["O1", "O2", "O2-bfloat16-unit-scale"],
)
def test_skipped_batch_keeps_every_weight_train_on_batch(amp):
    x, y, x_bad = _bad_batch()
    model = _bn_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **amp)
    model.train_on_batch(x, y)
    before = model.get_weights()
    model.train_on_batch(x_bad, y)
    assert int(_numpy(model.optimizer.skipped_steps)) == 1
    for b, a in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.train_on_batch(x, y)  # and training goes on
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert not np.array_equal(model.get_weights()[0], before[0])


@pytest.mark.one_backend
def test_skipped_batch_keeps_every_weight_in_fit():
    x, y, x_bad = _bad_batch()
    xs = np.concatenate([x, x_bad, x])
    ys = np.concatenate([y, y, y])
    model = _bn_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", amp_level="O2")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.get_weights())

    model.fit(xs, ys, batch_size=8, shuffle=False, epochs=1, verbose=0, callbacks=[Record()])
    for b, a in zip(seen[0], seen[1]):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(w)) for w in seen[2])


@pytest.mark.one_backend
def test_without_amp_level_batchnorm_statistics_are_lost():
    """The problem the guard solves: plain Keras + LSO keeps NaN moving stats."""
    x, y, x_bad = _bad_batch()
    model = _bn_model()
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.Adam()),
        loss="sparse_categorical_crossentropy",
    )
    model.train_on_batch(x, y)
    model.train_on_batch(x_bad, y)
    moving_mean = _numpy(model.get_layer("bn").moving_mean)
    assert not np.all(np.isfinite(moving_mean))
