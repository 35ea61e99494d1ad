"""A built optimizer passed to `compile(amp_level=...)` again, at another
level or dtype (`recompiled.py`): the model trains on, with a new optimizer
built for its variables as they are now and the old one's state."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


# (first level, first dtype, second level, second dtype, which optimizer is
# passed again). Before: TensorFlow's "Unknown variable" (here a KeyError of
# the master copies) for the first; "`inner_optimizer` is already wrapped by
# another LossScaleOptimizer" on every backend for the second; for the third,
# on every backend, a wrapper built for float32 variables had no copies for
# O3's bfloat16 ones, and no weight moved.
RECOMPILED = [
    ("O3", "bfloat16", "O3", "float16", "model.optimizer"),
    ("O3", "bfloat16", "O2", "float16", "the same Adam"),
    ("O1", "float16", "O3", "bfloat16", "model.optimizer"),
]


@pytest.mark.parametrize(
    "first, first_dtype, second, second_dtype, passed",
    RECOMPILED,
    ids=["-".join(cell) for cell in RECOMPILED],
)
def test_a_built_optimizer_compiled_again_at_another_dtype_trains_on(
    first, first_dtype, second, second_dtype, passed
):
    rng = np.random.default_rng(0)
    # Small enough that float16's first scale (2**15) overflows no gradient.
    x = rng.normal(scale=0.1, size=(16, 4)).astype("float32")
    y = rng.normal(scale=0.1, size=(16, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    adam = keras.optimizers.Adam(1e-2)
    model.compile(optimizer=adam, loss="mse", amp_level=first, amp_dtype=first_dtype)
    model.fit(x, y, batch_size=16, verbose=0)
    given = adam if passed == "the same Adam" else model.optimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=given, loss="mse", amp_level=second, amp_dtype=second_dtype)
    before = [_numpy(w) for w in model.trainable_variables]
    if first == "O3" and second == "O2":
        # The float32 weights are the master copies, not their bfloat16 rounding.
        rounded = [_numpy(keras.ops.cast(w, "bfloat16")) for w in before]
        assert any(not np.array_equal(w, r) for w, r in zip(before, rounded))
    # The first step's state carried over: the next is Adam's second step.
    assert int(_numpy(model.optimizer.iterations)) == 1
    history = model.fit(x, y, batch_size=16, verbose=0)
    assert history.history["skipped_steps"] == [0]
    after = [_numpy(w) for w in model.trainable_variables]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))
    assert int(_numpy(model.optimizer.iterations)) == 2
    # A new optimizer, and keras_mp says so: `given` trains the model no more.
    told = [str(w.message) for w in caught if "Use `model.optimizer`" in str(w.message)]
    assert len(told) == 1 and "a new Adam of the same settings" in told[0], told
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer is not given and model.optimizer.inner_optimizer is not adam
