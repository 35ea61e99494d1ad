"""A skipped step in a custom loop keeps the state a forward pass changed
(BatchNorm's moving statistics): `restore_on_skip` (TensorFlow, PyTorch, JAX
eager) and `stateless_apply(..., non_trainable_variables=(before, after))`
(JAX under `jax.jit`), README's loops, on one device and on the three
distributed roads of keras-io's guides (`tests/custom_loop_worker.py`).

Reference: the state before the skipped step, bit for bit; a clean step
must still move the statistics (so the guard cannot just always restore).
"""

import os

import hypothesis
import hypothesis.strategies as st
import keras
import numpy as np
import pytest

import keras_mp
from tests import processes

BACKEND = keras.backend.backend()
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS, "custom_loop_worker.py")


def _bn_model(level, dtype):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )
    keras_mp.apply_amp(model, level, dtype)
    float16 = dtype == "float16"
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=float16, initial_scale=2.0**15 if float16 else 1.0
    )
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def _eager_step(model, optimizer, x, y, guarded=True):
    """README's loop for this backend, run eagerly (JAX: `apply`)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    guard = optimizer.restore_on_skip(model) if guarded else _Nothing()
    with guard:
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                scaled = optimizer.scale_loss(loss_fn(y, model(x, training=True)))
            grads = tape.gradient(scaled, model.trainable_variables)
        elif BACKEND == "torch":
            model.zero_grad()
            optimizer.scale_loss(loss_fn(y, model(x, training=True))).backward()
            grads = [v.value.grad for v in model.trainable_variables]
        else:
            import jax

            def loss_of(values):
                mapping = zip(model.trainable_variables, values)
                with keras.StatelessScope(state_mapping=mapping) as scope:
                    loss = optimizer.scale_loss(loss_fn(y, model(x, training=True)))
                # The forward pass's new statistics, for the eager step to keep.
                return loss, [scope.get_current_value(v) for v in model.non_trainable_variables]

            values = [v.value for v in model.trainable_variables]
            grads, statistics = jax.grad(loss_of, has_aux=True)(values)
            for variable, value in zip(model.non_trainable_variables, statistics):
                if value is not None:
                    variable.assign(value)
        optimizer.apply(grads, model.trainable_variables)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_restore_on_skip_keeps_batchnorm_statistics_of_a_skipped_step(level, dtype):
    model, optimizer = _bn_model(level, dtype)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.integers(0, 3, size=8).astype("int32")
    _eager_step(model, optimizer, x, y)  # a clean step moves them
    statistics = _values(model.non_trainable_variables)
    weights = _values(model.trainable_variables)
    bad = x.copy()
    bad[2, 1] = np.nan
    _eager_step(model, optimizer, bad, y)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 1
    for old, variable in zip(statistics, model.non_trainable_variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable), variable.path)
    for old, variable in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable), variable.path)
    _eager_step(model, optimizer, x, y)  # and the next clean one moves them again
    moved = [
        not np.array_equal(a, b) for a, b in zip(statistics, _values(model.non_trainable_variables))
    ]
    assert all(moved), moved


def test_without_the_guard_a_nan_batch_poisons_the_statistics():
    """What the guard prevents (Keras's own policies do the same)."""
    model, optimizer = _bn_model("O2", "float16")
    x = np.ones((8, 6), "float32")
    x[0, 0] = np.nan
    _eager_step(model, optimizer, x, np.zeros(8, "int32"), guarded=False)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 1
    assert not all(np.isfinite(v).all() for v in _values(model.non_trainable_variables))


@hypothesis.settings(deadline=None, max_examples=20)
@hypothesis.given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.lists(st.integers(), min_size=1, max_size=3),
    )
)
def test_restore_on_skip_refuses_what_is_not_a_model_or_variables(target):
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="restore_on_skip. takes a model"):
        optimizer.restore_on_skip(target)


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply's pair: JAX's jitted loops")
@pytest.mark.parametrize(
    "pair",
    [[1, 2], ([1.0],), ([1.0], [1.0, 2.0]), "before", ([1.0], None)],
    ids=["numbers", "one", "lengths", "string", "none"],
)
def test_stateless_apply_refuses_a_pair_that_is_not_before_and_after(pair):
    model, optimizer = _bn_model("O2", "float16")
    values = [v.value for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"non_trainable_variables. must be a pair"):
        optimizer.stateless_apply(
            [v.value for v in optimizer.variables], values, values, non_trainable_variables=pair
        )


# -- keras-io's distributed guides, in processes of their own -----------------------


# The levels each loop runs in the worker.
LOOP_LEVELS = {
    "tf_mirrored": ("O2 float16",),
    "jax_sharding": ("O3 bfloat16",),
    "torch_ddp": ("O2 float16",),
}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_mirrored_strategy_custom_loop_keeps_batchnorm_statistics_on_a_skipped_step():
    processes.run_cases(WORKER, "tf_mirrored", "tensorflow", LOOP_LEVELS["tf_mirrored"])


@pytest.mark.skipif(BACKEND != "jax", reason="jax.sharding")
@pytest.mark.slow(reason="a JAX process of its own on four host devices, compiling its loop")
def test_jax_sharding_loop_keeps_batchnorm_statistics_on_a_skipped_step():
    processes.run_cases(WORKER, "jax_sharding", "jax", LOOP_LEVELS["jax_sharding"])


@pytest.mark.skipif(BACKEND != "torch", reason="DistributedDataParallel")
@pytest.mark.slow(reason="two PyTorch processes meeting over gloo, each importing Keras")
def test_ddp_loop_on_two_processes_keeps_batchnorm_statistics_and_one_set_of_weights():
    """Two gloo ranks on 127.0.0.1; only rank 0's half of one batch has a
    NaN. Each rank checks its own skip in-process; both must report the
    same weights (DDP's all-reduced gradients, one skip decision)."""
    first, second = processes.run_side_by_side(WORKER, "torch_ddp", "torch")
    assert [r["level"] for r in first] == list(LOOP_LEVELS["torch_ddp"])
    for a, b in zip(first, second):
        assert (a["rank"], b["rank"]) == (0, 1)
        assert {**a, "rank": None} == {**b, "rank": None}, (a, b)
        assert a["skipped_steps"] == 1
