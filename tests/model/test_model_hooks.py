"""What keras_mp changes in Keras's Model beyond compile (`model_hooks.py`):
half additional losses summed in floatx, and `fit` wrapping a bare optimizer."""

import keras
import numpy as np
import pytest

import keras_mp

BACKEND = keras.backend.backend()
_NOT_ON_JAX = pytest.mark.skipif(
    BACKEND == "jax", reason="JAX promotes half and float32: its cell is O3's"
)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int32")


class AddsItsOwnLoss(keras.layers.Layer):
    """A user's layer with `add_loss` in its compute dtype (a VAE's KL term)."""

    def call(self, x):
        self.add_loss(0.5 * keras.ops.mean(keras.ops.square(x)))
        return x


def _regularized_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(
        16,
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(0.05),
        activity_regularizer=keras.regularizers.L2(0.01),
    )(inputs)
    h = keras.layers.ActivityRegularization(l1=0.01)(h)
    h = AddsItsOwnLoss()(h)
    outputs = keras.layers.Dense(2, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def _losses_and_model(level=None, half=None, how="compile"):
    """The two steps' losses (one batch a step: each step's loss is taken
    before its update) of `_regularized_model` at `level`, and the model."""
    x, y = _data()
    model = _regularized_model()
    amp, optimizer = {}, keras.optimizers.Adam(1e-2)
    if level is not None and how == "compile":
        amp = {"amp_level": level, "amp_dtype": half}
    elif level is not None:
        keras_mp.apply_amp(model, level, half)
        optimizer = keras_mp.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", **amp)
    history = model.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    return history.history["loss"], model


@pytest.fixture(scope="module")
def float32_losses():
    """The float32 model's losses, its added losses a good part of them."""
    x, y = _data()
    losses, _ = _losses_and_model()
    predictions = _regularized_model().predict(x, verbose=0)  # the same weights, float32
    without_regularization = float(
        _numpy(keras.losses.sparse_categorical_crossentropy(y, predictions)).mean()
    )
    # What the test is about: the added losses are a good part of the total.
    assert losses[0] > without_regularization + 0.1, (losses, without_regularization)
    return losses


# TensorFlow refused the sum: it runs a cell of each kind of half loss (O1's
# activity regularization and `add_loss`, O3's half weights' regularizers),
# one through each way of setting the level. The cast is the same line for
# every cell: PyTorch, whose steps cost least, runs them all; JAX, which
# promotes half and float32 as PyTorch does but collects the losses of its
# stateless call its own way, the O3 one.
_ON_TORCH = pytest.mark.skipif(BACKEND != "torch", reason="a cell of the grid: all on PyTorch")
REGULARIZED = [
    pytest.param("O1", "float16", "compile", marks=_NOT_ON_JAX),
    pytest.param("O1", "float16", "apply_amp", marks=_ON_TORCH),
    pytest.param("O2", "bfloat16", "compile", marks=_ON_TORCH),
    pytest.param("O2", "bfloat16", "apply_amp", marks=_ON_TORCH),
    pytest.param("O3", "float16", "compile", marks=_ON_TORCH),
    pytest.param("O3", "float16", "apply_amp", marks=_ON_TORCH),
    pytest.param("O3", "bfloat16", "compile", marks=_ON_TORCH),
    ("O3", "bfloat16", "apply_amp"),
]


@pytest.mark.parametrize("level, half, how", REGULARIZED)
def test_regularization_and_add_loss_count_in_float32(level, half, how, float32_losses):
    """Activity regularization, `add_loss` in a half layer and O3's
    `kernel_regularizer` on half weights give half losses; Keras sums them
    with the float32 loss, which TensorFlow refused (a TypeError at the
    first step, as under Keras's own `mixed_float16`; tf.keras 2 trained
    them). Through `compile(amp_level=...)` or `apply_amp` and a plain
    `compile`, each level's first loss is the float32 model's,
    regularization included, within the half dtype's rounding."""
    losses, model = _losses_and_model(level, half, how)
    rtol = 2e-2 if half == "bfloat16" else 5e-3
    np.testing.assert_allclose(losses[0], float32_losses[0], rtol=rtol)
    assert losses[1] < losses[0]  # and it trains
    assert all(np.isfinite(_numpy(w)).all() for w in model.trainable_variables)


@pytest.mark.one_backend
def test_fit_wraps_the_bare_optimizer_of_a_model_made_half_after_compile(capsys):
    """`apply_amp` after `compile`: the model's Adam is bare, and its float16
    gradients would go unscaled. `fit` wraps it first, says so, and trains;
    a model keras_mp did not touch keeps its optimizer as given."""
    x, y = _data()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    adam = keras.optimizers.Adam(1e-2)
    model.compile(optimizer=adam, loss="sparse_categorical_crossentropy")
    keras_mp.apply_amp(model, "O2")
    history = model.fit(x, y, epochs=2, verbose=0)
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is adam and model.optimizer.dynamic
    assert "keras_mp: wrapped `optimizer` (Adam" in capsys.readouterr().out
    assert history.history["loss"][1] < history.history["loss"][0]

    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    sgd = keras.optimizers.SGD()
    plain.compile(optimizer=sgd, loss="sparse_categorical_crossentropy")
    plain.fit(x, y, epochs=1, verbose=0)
    assert plain.optimizer is sgd


@pytest.mark.one_backend
def test_an_fp8_checkpoint_loaded_before_compile_names_the_order_that_works(tmp_path):
    """Issue 63.8: building a model, `load_weights` from an FP8 checkpoint,
    then `compile(amp_dtype="float8")` failed with Keras's "A total of 1
    objects could not be loaded"; the error now says to compile first, and
    that order loads the weights exactly."""

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((16,))] + [keras.layers.Dense(16, name=f"d{i}") for i in range(3)]
        )

    any_size = keras_mp.Float8Recipe(small_gemm=None)  # FP8 on these tiny matmuls

    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    trained = model()
    trained.compile(
        optimizer="adam", loss="mse", amp_level="O2", amp_dtype="float8", float8_recipe=any_size
    )
    trained.fit(x, x, epochs=1, verbose=0)
    path = str(tmp_path / "fp8.weights.h5")
    trained.save_weights(path)
    with pytest.raises(ValueError, match="compile.*amp_dtype='float8'.*then"):
        model().load_weights(path)
    resumed = model()
    resumed.compile(
        optimizer="adam", loss="mse", amp_level="O2", amp_dtype="float8", float8_recipe=any_size
    )
    resumed.load_weights(path)
    np.testing.assert_array_equal(resumed.predict(x, verbose=0), trained.predict(x, verbose=0))


def test_fp8_weights_load_as_fp8_into_layers_the_size_rule_keeps_in_bfloat16(tmp_path):
    """Weights saved with every aligned matmul in FP8 (`small_gemm=None`,
    the default before the size rule) into the same model compiled under
    the default recipe, which keeps the tiny middle layer in bfloat16: it
    failed with Keras's bare "Layer 'd1' expected 2 variables, but received
    8". The layer is put in FP8 and loads exactly, as a `.keras` file's
    does, and trains on in FP8."""

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((16,))] + [keras.layers.Dense(16, name=f"d{i}") for i in range(3)]
        )

    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    compiled = dict(optimizer="sgd", loss="mse", amp_level="O2", amp_dtype="float8")
    saved = model()
    saved.compile(**compiled, float8_recipe=keras_mp.Float8Recipe(small_gemm=None))
    saved.train_on_batch(x, x)
    path = str(tmp_path / "fp8.weights.h5")
    saved.save_weights(path)
    loaded = model()
    loaded.compile(**compiled)
    assert loaded.get_layer("d1").dtype_policy.name == "mixed_bfloat16"
    loaded.load_weights(path)
    assert loaded.get_layer("d1").dtype_policy.name == "float8_from_mixed_bfloat16"
    rules = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(loaded).rows}
    assert rules[f"{loaded.name}/d1"] == "O2 float8: FP8 in the weights loaded, kept in FP8"
    np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(saved(x)))
    loaded.train_on_batch(x, x)
    saved.train_on_batch(x, x)
    np.testing.assert_array_equal(_numpy(loaded(x)), _numpy(saved(x)))


def _numpy(tensor):
    return keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32"))


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's own: elsewhere assign writes in place"
)
@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_a_second_fit_with_ema_runs(level, dtype):
    """`use_ema=True`: `fit` ends by assigning each weight its moving average
    (O3: each float32 copy), and on JAX both then held one array; the next
    `fit` donates the state and failed ("Attempt to donate the same buffer
    twice"), as it does under Keras's own policies. Now it trains on."""
    x, y = _data()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2, use_ema=True),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        amp_dtype=dtype,
    )
    model.fit(x, y, batch_size=48, verbose=0)
    averaged = [_numpy(w) for w in model.trainable_variables]
    history = model.fit(x, y, batch_size=48, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    after = [_numpy(w) for w in model.trainable_variables]
    assert all(not np.array_equal(a, b) for a, b in zip(averaged, after))
