"""`fit`'s train step under keras_mp (`train_step.py`): a NaN batch injected.

The batch's step is skipped (weights bit-identical to the step before), the
scale backs off, training goes on, and the run ends where a run without the
bad batch ends (compared against that run, not against itself).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_mp

BACKEND = keras.backend.backend()
BATCH = 16
BAD_BATCH = 2

MODES = ["eager_or_default", "jit"] if BACKEND != "torch" else ["eager_or_default"]


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _data(with_nan):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6 * BATCH, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    if with_nan:
        x[BAD_BATCH * BATCH + 3, 4] = np.nan
    return x, y


def _model(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    keras.config.set_dtype_policy("float32")
    return model


def _compiled_with_adam(policy, mode, dynamic_growth_steps, **compile_kwargs):
    """`_model(policy)` compiled with Adam in a LossScaleOptimizer starting at 2**10."""
    model = _model(policy)
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        initial_scale=2.0**10,
        dynamic_growth_steps=dynamic_growth_steps,
    )
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        jit_compile=(mode == "jit"),
        **compile_kwargs,
    )
    return model, optimizer


class WeightsPerBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.seen = getattr(self, "seen", []) + [[np.array(w) for w in self.model.get_weights()]]


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's eager fit")
def test_eager_fit_on_jax_compiles_the_optimizer_step_once(jax_skip_form):
    """`fit` with `jit_compile=False` runs JAX's step op by op; the optimizer's
    step is compiled once, not traced again at every batch (0.2 s each)."""
    x, y = _data(with_nan=True)
    model = _model("float32")
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    traced = []
    check_finite = optimizer.check_finite
    optimizer.check_finite = lambda grads: traced.append(1) or check_finite(grads)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert len(traced) == 1
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 2  # the NaN batch, twice


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_fit_skips_a_nan_batch_and_loses_nothing(mode, policy, jax_skip_form):
    x, y = _data(with_nan=True)
    model, optimizer = _compiled_with_adam(policy, mode, dynamic_growth_steps=100)
    assert model.optimizer is optimizer
    recorder = WeightsPerBatch()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])

    before, after = recorder.seen[BAD_BATCH - 1], recorder.seen[BAD_BATCH]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    for weights in recorder.seen[BAD_BATCH + 1 :]:
        assert all(np.all(np.isfinite(w)) for w in weights)
    assert not np.array_equal(recorder.seen[-1][0], after[0])  # training went on
    assert int(_numpy(optimizer.skipped_steps)) == 1
    assert int(_numpy(optimizer.iterations)) == 5
    assert float(_numpy(optimizer.loss_scale)) == 2.0**9

    # The same run without the bad batch gives the same weights.
    x_clean, y_clean = _data(with_nan=False)
    keep = np.ones(len(x_clean), bool)
    keep[BAD_BATCH * BATCH : (BAD_BATCH + 1) * BATCH] = False
    reference, _ = _compiled_with_adam(policy, mode, dynamic_growth_steps=100)
    # The scale differs after the skip (2**9 vs 2**10): a power of two, so
    # the unscaled gradients, and hence the weights, agree to rounding.
    reference.fit(
        x_clean[keep], y_clean[keep], batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_fit_grows_the_scale(mode):
    x, y = _data(with_nan=False)
    model = _model("mixed_float16")
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=4.0, dynamic_growth_steps=2
    )
    model.compile(
        optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=(mode == "jit")
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert float(_numpy(optimizer.loss_scale)) == 32.0  # 6 steps: 3 growths
    assert int(_numpy(optimizer.good_steps)) == 0


@pytest.mark.skipif(BACKEND == "torch", reason="Keras runs one step per execution on PyTorch")
@pytest.mark.parametrize("mode", MODES)
def test_steps_per_execution_steps_the_scale_per_batch(mode):
    """`steps_per_execution=3` runs three steps in one compiled call: the
    scale grows, backs off and skips per batch, as with one step a call."""
    x, y = _data(with_nan=True)
    runs = []
    for steps_per_execution in (1, 3):
        model, optimizer = _compiled_with_adam(
            "mixed_float16", mode, dynamic_growth_steps=2, steps_per_execution=steps_per_execution
        )
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        state = [
            float(_numpy(v))
            for v in (
                optimizer.loss_scale,
                optimizer.good_steps,
                optimizer.skipped_steps,
                optimizer.iterations,
            )
        ]
        runs.append((model.get_weights(), state, history.history))
    (weights, state, history), (weights_3, state_3, history_3) = runs
    # Batches 0-1 grow the scale to 2**11; the NaN batch 2 backs it off to
    # 2**10 and is skipped; batches 3-4 grow it to 2**11; batch 5 counts one.
    assert state == state_3 == [2.0**11, 1.0, 1.0, 5.0]
    assert history["loss_scale"] == history_3["loss_scale"] == [2.0**11]
    assert history["skipped_steps"] == history_3["skipped_steps"] == [1.0]
    for got, want in zip(weights_3, weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_an_epoch_of_overflowing_steps_reports_its_loss(mode):
    """A scale so large that every step's half gradients overflow: every step
    is skipped and the weights stay, but the batches' losses were finite, and
    the epoch reports them (as Keras's own LossScaleOptimizer does), not the
    0 of an empty mean. The reference is `evaluate` on the same, unchanged
    weights."""
    x, y = _data(with_nan=False)
    model = _model("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level="O2",
        loss_scale=2.0**40,
        jit_compile=(mode == "jit"),
    )
    before = model.get_weights()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert history.history["skipped_steps"] == [len(x) // BATCH]
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    loss, accuracy = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert loss > 0.1
    np.testing.assert_allclose(history.history["loss"], [loss], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], [accuracy], rtol=1e-6)


def test_fit_with_embedding_gradients():
    """Embedding gradients are sparse (tf.IndexedSlices) on TensorFlow."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(64, 5))
    y = (x[:, 0] > 25).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=2)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    before = model.get_weights()[0].copy()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.array_equal(model.get_weights()[0], before)
    assert float(_numpy(optimizer.loss_scale)) == 2.0**17  # 4 finite steps: 2 growths


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("how", ["run_eagerly", "no_jit"])
def test_fit_evaluate_predict_run_eagerly_at_every_level(level, how):
    """Debugging in a notebook starts with `run_eagerly=True`.

    The same epoch as a compiled one, at every level, with a NaN batch
    skipped: the loss scale and skipped steps reach the logs as numbers.
    """
    x, y = _data(with_nan=True)
    model = _model("float32")
    kwargs = {"run_eagerly": True} if how == "run_eagerly" else {"jit_compile": False}
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        loss_scale="dynamic",
        **kwargs,
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    (skipped,) = history.history["skipped_steps"]
    # The NaN batch; at O3 (float16 everywhere) the first scale may overflow too.
    assert skipped == 1 or (level == "O3" and skipped == 2)
    assert history.history["loss_scale"] == [2.0**15 / 2**skipped]
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    loss = model.evaluate(x[: 2 * BATCH], y[: 2 * BATCH], verbose=0)
    assert np.isfinite(loss)
    predictions = model.predict(x[: 2 * BATCH], verbose=0)
    assert predictions.dtype == np.float32 and np.isfinite(predictions).all()


def _guide_train_step(scaled):
    """Keras's "customizing what happens in `fit`" guide's `train_step` for
    this backend; `scaled` adds the one line that loss scaling needs."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                scaled_loss = self.optimizer.scale_loss(loss) if scaled else loss
            grads = tape.gradient(scaled_loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    elif BACKEND == "torch":
        import torch

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled_loss = self.optimizer.scale_loss(loss) if scaled else loss
            scaled_loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
            return {"loss": loss}

    else:
        import jax

        def train_step(self, state, data):
            trainables, non_trainables, optimizer_variables, metrics_variables = state
            x, y = data

            def loss_and_updates(trainables, non_trainables):
                y_pred, non_trainables = self.stateless_call(
                    trainables, non_trainables, x, training=True
                )
                loss = self.compute_loss(x, y, y_pred)
                if scaled:
                    mapping = list(zip(self.optimizer.variables, optimizer_variables))
                    with keras.StatelessScope(state_mapping=mapping):
                        loss = self.optimizer.scale_loss(loss)
                return loss, non_trainables

            grads, non_trainables = jax.grad(loss_and_updates, has_aux=True)(
                trainables, non_trainables
            )
            trainables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainables
            )
            state = (trainables, non_trainables, optimizer_variables, metrics_variables)
            return {}, state

    return type("GuideModel", (keras.Model,), {"train_step": train_step})


@pytest.mark.parametrize("level, dtype", [("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_a_custom_train_step_that_does_not_scale_its_loss_is_told(scaled, level, dtype):
    """Keras's guide to a custom `train_step` never scales the loss. Under a
    LossScaleOptimizer its gradients were divided by a scale they were never
    multiplied by, and the model hardly trained, silently (so under Keras's
    own mixed_float16). Inside `fit` keras_mp knows, per step, whether the
    loss reached `scale_loss`: if not, the gradients are applied as they are
    (checked, unscaled by 1) and a warning names the line to add; with it,
    the step is loss-scaled. Either way it trains as float32 does, at every
    level (in bfloat16 there is no scale, and nothing to warn of)."""
    x, y = _data(with_nan=False)

    def fit(level, dtype="float16"):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = _guide_train_step(scaled)(
            inputs, keras.layers.Dense(2, activation="softmax")(hidden)
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss="sparse_categorical_crossentropy",
            amp_level=level,
            amp_dtype=dtype,
        )
        before = model.get_weights()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        told = [w for w in caught if "loss was never scaled" in str(w.message)]
        moved = sum(np.abs(a - b).sum() for a, b in zip(model.get_weights(), before))
        return told, moved, model.get_weights()

    told_o0, moved_o0, reference = fit("O0")  # no LossScaleOptimizer
    told, moved, weights = fit(level, dtype)
    assert told_o0 == []
    if scaled or dtype == "bfloat16":
        assert told == []
    else:
        assert len(told) == 1 and "self.optimizer.scale_loss(loss)" in str(told[0].message)
    assert moved > 0.5 * moved_o0
    for got, want in zip(weights, reference):
        np.testing.assert_allclose(got, want, atol=2e-2 if dtype == "float16" else 5e-2)
