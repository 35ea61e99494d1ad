"""`fit`'s train step under keras_mp (`train_step.py`): a NaN batch injected.

The batch's step is skipped (weights bit-identical to the step before), the
scale backs off, training goes on, and every other step is the step of a run
without the bad batch (compared against that run step by step, not against
itself). One model per mode of `fit` runs both: the reference reuses the
compiled step, so each mode is compiled once.
"""

import contextlib
import functools
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.backends import common as backends_common

BACKEND = keras.backend.backend()
BATCH = 16
BAD_BATCH = 2


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


# The cells of the NaN-batch run: each mode of `fit` on this backend, and on
# JAX each form of the skip once (both forms are proven op by op in
# test_loss_scale_optimizer.py): the GPU's selects where `fit` compiles, the
# CPU's `lax.cond` where it runs op by op.
CELLS = {
    "tensorflow": [("eager_or_default", None), ("jit", None)],
    "jax": [("eager_or_default", "cond"), ("jit", "select")],
    "torch": [("eager_or_default", None)],
}[BACKEND]
# The mode each backend runs cheapest on a CPU, for what every mode runs
# alike: TensorFlow's graph (XLA compiles for longer), JAX's jit (its eager
# step dispatches op by op), PyTorch's eager step.
CHEAPEST = "jit" if BACKEND == "jax" else "eager_or_default"


@contextlib.contextmanager
def _in_skip_form(form):
    """The JAX skip's form for what is traced inside (None: the platform's)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if form is not None:
            monkeypatch.setenv(backends_common.SKIP_FORM_VARIABLE, form)
        yield


@functools.lru_cache(maxsize=None)
def _nan_run(mode, form):
    """One mixed_float16 model, Adam in a LossScaleOptimizer from 2**10
    growing every 2 steps, fit for an epoch on data with a NaN in batch 2,
    then, from the same initial weights and optimizer state and with the
    same compiled step, on the same data without that batch: the weights
    after each batch of both runs, and the optimizer's state after the
    first."""
    with _in_skip_form(form):
        model, optimizer = _compiled_with_adam("mixed_float16", mode, dynamic_growth_steps=2)
        assert model.optimizer is optimizer  # compile keeps the one given
        optimizer.build(model.trainable_variables)
        weights = model.get_weights()
        state = [_numpy(v) for v in optimizer.variables]
        x, y = _data(with_nan=True)
        recorder = WeightsPerBatch()
        history = model.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]
        )
        after = {
            name: float(_numpy(getattr(optimizer, name)))
            for name in ("loss_scale", "good_steps", "skipped_steps", "iterations")
        }
        model.set_weights(weights)
        for variable, value in zip(optimizer.variables, state):
            variable.assign(value)
        x_clean, y_clean = _data(with_nan=False)
        keep = np.ones(len(x_clean), bool)
        keep[BAD_BATCH * BATCH : (BAD_BATCH + 1) * BATCH] = False
        reference = WeightsPerBatch()
        model.fit(
            x_clean[keep],
            y_clean[keep],
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[reference],
        )
    return recorder.seen, reference.seen, after, history.history, model.get_weights()


@pytest.mark.parametrize("mode, form", CELLS)
def test_fit_skips_a_nan_batch_and_loses_nothing(mode, form):
    """The NaN batch's step changes no weight; the scale grows every two
    finite steps and halves at the skip; every other step is the step of a
    run that never saw the bad batch, compared step by step (the scale
    differs after the skip, 2**10 against 2**11, a power of two: the
    unscaled gradients, and hence the weights, agree to rounding)."""
    seen, reference, state, history, _ = _nan_run(mode, form)
    assert len(seen) == 6 and len(reference) == 5
    for b, a in zip(seen[BAD_BATCH - 1], seen[BAD_BATCH]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(seen[-1][0], seen[BAD_BATCH][0])  # training went on
    assert all(np.isfinite(w).all() for w in seen[-1])
    for got, want in zip(seen[:BAD_BATCH] + seen[BAD_BATCH + 1 :], reference):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Batches 0-1 grow the scale to 2**11; the NaN batch 2 backs it off to
    # 2**10 and is skipped; batches 3-4 grow it to 2**11; batch 5 counts one.
    assert state == {"loss_scale": 2.0**11, "good_steps": 1, "skipped_steps": 1, "iterations": 5}
    assert history["loss_scale"] == [2.0**11] and history["skipped_steps"] == [1.0]


@pytest.mark.skipif(BACKEND == "torch", reason="Keras runs one step per execution on PyTorch")
def test_steps_per_execution_steps_the_scale_per_batch():
    """`steps_per_execution=3` runs three steps in one compiled call: the
    scale grows, backs off and skips per batch, as with one step a call.
    The loop around the step is Keras's own in every mode: one mode proves it."""
    mode, form = next(cell for cell in CELLS if cell[0] == CHEAPEST)
    _, _, state, history, weights = _nan_run(mode, form)
    x, y = _data(with_nan=True)
    with _in_skip_form(form):
        model, optimizer = _compiled_with_adam(
            "mixed_float16", mode, dynamic_growth_steps=2, steps_per_execution=3
        )
        history_3 = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    state_3 = {name: float(_numpy(getattr(optimizer, name))) for name in state}
    assert state_3 == state
    assert history_3["loss_scale"] == history["loss_scale"]
    assert history_3["skipped_steps"] == history["skipped_steps"]
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_epoch_of_overflowing_steps_reports_its_loss():
    """A scale so large that every step's half gradients overflow: every step
    is skipped and the weights stay, but the batches' losses were finite, and
    the epoch reports them (as Keras's own LossScaleOptimizer does), not the
    0 of an empty mean. The reference is `evaluate` on the same, unchanged
    weights. The metrics' restore is the step's own code in every mode: one
    mode proves it."""
    x, y = _data(with_nan=False)
    model = _model("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level="O2",
        loss_scale=2.0**40,
        jit_compile=(CHEAPEST == "jit"),
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


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="sparse gradients (tf.IndexedSlices) are TensorFlow's own"
)
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


# Each level's cell runs the same eager step: PyTorch, whose steps cost
# least, runs every level; TensorFlow one. JAX runs `jit_compile=False` as
# `run_eagerly=True` (Keras's JAX trainer): its eager cell of the NaN-batch
# run above is this path.
_ON_TORCH = pytest.mark.skipif(BACKEND != "torch", reason="a level's cell: every one on PyTorch")


@pytest.mark.skipif(BACKEND == "jax", reason="JAX's eager step: the NaN-batch run's eager cell")
@pytest.mark.parametrize(
    "level",
    [
        pytest.param("O0", marks=_ON_TORCH),
        pytest.param("O1", marks=_ON_TORCH),
        "O2",
        pytest.param("O3", marks=_ON_TORCH),
    ],
)
def test_fit_evaluate_predict_run_eagerly_at_every_level(level):
    """Debugging in a notebook starts with `run_eagerly=True`.

    The same epoch as a compiled one, at every level, with a NaN batch
    skipped: the loss scale and skipped steps reach the logs as numbers.
    """
    x, y = _data(with_nan=True)
    model = _model("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        loss_scale="dynamic",
        run_eagerly=True,
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


@functools.lru_cache(maxsize=None)
def _guide_fit(scaled, level, dtype="float16"):
    """The guide's model fit for two epochs at `level`: the "loss was never
    scaled" warnings, how far its weights moved, and its weights."""
    x, y = _data(with_nan=False)
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = _guide_train_step(scaled)(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
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


@pytest.mark.parametrize(
    "scaled, level, dtype",
    [
        (False, "O2", "float16"),
        (True, "O1", "float16"),
        # Whether there is a scale to warn of is the optimizer's decision.
        pytest.param(False, "O3", "bfloat16", marks=pytest.mark.one_backend),
    ],
    ids=["unscaled-O2-float16", "scaled-O1-float16", "unscaled-O3-bfloat16"],
)
def test_a_custom_train_step_that_does_not_scale_its_loss_is_told(scaled, level, dtype):
    """Keras's guide to a custom `train_step` never scales the loss. Under a
    LossScaleOptimizer its gradients were divided by a scale they were never
    multiplied by, and the model hardly trained, silently (so under Keras's
    own mixed_float16). Inside `fit` keras_mp knows, per step, whether the
    loss reached `scale_loss`: if not, the gradients are applied as they are
    (checked, unscaled by 1) and a warning names the line to add; with it,
    the step is loss-scaled. Either way it trains as float32 does, at every
    level (in bfloat16 there is no scale, and nothing to warn of)."""
    told_o0, moved_o0, reference = _guide_fit(False, "O0")  # no LossScaleOptimizer
    told, moved, weights = _guide_fit(scaled, level, dtype)
    assert told_o0 == []
    if scaled or dtype == "bfloat16":
        assert told == []
    else:
        assert len(told) == 1 and "self.optimizer.scale_loss(loss)" in str(told[0].message)
    assert moved > 0.5 * moved_o0
    for got, want in zip(weights, reference):
        np.testing.assert_allclose(got, want, atol=2e-2 if dtype == "float16" else 5e-2)


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's step reads its skip flag on the host")
def test_a_torch_step_that_applies_puts_nothing_back():
    """PyTorch's step knows on the host whether it skipped (its one flag
    read, as GradScaler's): a step that applied puts no state back, with no
    select and no assignment per variable (on the digits MLP they were a
    fifth of keras_mp's cost per step). A skipped step still restores
    BatchNorm's statistics (`test_compile.py`'s skipped-batch tests)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    x, y = _data(with_nan=False)
    counts = []
    for settings in ({}, {"loss_scale": None}):  # guarded (bfloat16's check), plain
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile("adam", loss, amp_level="O2", amp_dtype="bfloat16", **settings)
        model.train_on_batch(x[:BATCH], y[:BATCH])
        with Count() as count:
            model.train_on_batch(x[:BATCH], y[:BATCH])
        counts.append(count.ops)
    guarded, plain = counts
    assert guarded["copy_"] == plain["copy_"], (guarded, plain)
    # `scale_loss`'s factor (1 where the loss is finite, NaN where not).
    assert guarded["where"] == plain["where"] + 1, (guarded, plain)
