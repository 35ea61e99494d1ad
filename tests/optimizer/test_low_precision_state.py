"""Adam's moments in low precision: `LossScaleOptimizer(moment_dtypes=...)`.

The references: Keras's own Adam (float32 moments) trained on the same
batches from the same weights, and the moments as float32 Adam holds them.

The tolerance of "follows": the moments are rounded once a step, the first
to E4M3 (unit roundoff u = 2**-4, relative to each entry) and the second to
float16 (2**-11); the update is computed from this step's float32 values.
The loss of each step of the run is within u of Adam's (the same argument
as FP8 matmuls', `tests/precision/test_float8.py`); Adam's loss falls by
more than 2u of itself over the run, so an optimizer that lost its moments
leaves the band.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_mp

BACKEND = keras.backend.backend()
E4M3_ROUNDOFF = 2.0**-4
STEPS = 8


def _data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data[:256] / 16.0).astype("float32"), digits.target[:256].astype("int32")


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _lso(moment_dtypes, inner=None, **kwargs):
    inner = inner or keras.optimizers.Adam(3e-3)
    return keras_mp.LossScaleOptimizer(
        inner, dynamic=False, initial_scale=1.0, moment_dtypes=moment_dtypes, **kwargs
    )


def _train(moment_dtypes, steps=STEPS, **amp):
    model = _model()
    x, y = _data()
    model.compile(
        optimizer=_lso(moment_dtypes),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **amp,
    )
    history = model.fit(x, y, batch_size=len(x), epochs=steps, shuffle=False, verbose=0)
    return model, np.array(history.history["loss"])


def _numpy(x):
    return np.array(keras.ops.convert_to_numpy(x))


def _moments(optimizer, kind):
    return [v for v in optimizer.inner_optimizer.variables if v.name.endswith(f"_{kind}")]


def test_float32_moments_are_keras_adam_line_for_line():
    _, adam = _train(None)
    _, same = _train(("float32", "float32"))
    np.testing.assert_allclose(same, adam, rtol=1e-6)


@pytest.mark.parametrize(
    "moment_dtypes, amp",
    [
        ("float8", {}),
        (("float8", "bfloat16"), {"amp_level": "O2", "amp_dtype": "bfloat16"}),
        ("float8", {"amp_level": "O3", "amp_dtype": "bfloat16"}),
    ],
)
def test_fp8_moments_follow_float32_adam(moment_dtypes, amp):
    _, adam = _train(None, **amp)
    model, low = _train(moment_dtypes, **amp)
    assert adam[-1] < (1 - 2 * E4M3_ROUNDOFF) * adam[0], adam  # the band can be left
    assert np.all(np.abs(low - adam) <= E4M3_ROUNDOFF * adam), (low, adam)
    first, second = (_moments(model.optimizer, k) for k in ("momentum", "velocity"))
    assert {v.dtype for v in first} == {"uint8"}  # E4M3's codes
    assert {v.dtype for v in second} == {
        keras_mp.LossScaleOptimizer(
            keras.optimizers.Adam(), moment_dtypes=moment_dtypes
        ).moment_dtypes[1]
    }


def test_the_codes_are_e4m3_and_the_moments_are_adams_rounded():
    """One step from zero moments: Adam's first moment is 0.1 g; the codes,
    read as E4M3 (ml_dtypes) and scaled, are it rounded to one of its two
    E4M3 neighbours (stochastically), with the tensor's largest entry at
    448; over the tensor about as many round up as down."""
    model, _ = _train("float8", steps=1)
    reference, _ = _train(None, steps=1)
    for low, full in zip(
        _moments(model.optimizer, "momentum"), _moments(reference.optimizer, "momentum")
    ):
        scale = _numpy(
            next(
                v
                for v in model.optimizer.inner_optimizer.variables
                if v.name == f"{low.name}_scale"
            )
        )
        want = _numpy(full)
        assert np.isclose(scale, np.abs(want).max() / 448.0, rtol=1e-6)
        codes = _numpy(low).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        x = want / scale
        # E4M3's spacing at |x|: 2**(exponent - 3), 2**-9 below 2**-6.
        spacing = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 2.0**-6))), -6) - 3)
        down = np.floor(x / spacing) * spacing
        assert np.all((codes == down) | (codes == down + spacing)), (codes, x)
        inexact = down != x
        up = (codes > x)[inexact]
        assert 0.2 < up.mean() < 0.8, up.mean()


def test_state_bytes_fall_by_the_expected_ratio_and_the_report_counts_them():
    """3 bytes a weight for 8 (62.5% less), and `speed_report`'s optimizer
    bytes are the built optimizer's (its non-scalar variables), at O2 and O3."""
    x, _ = _data()

    def state_bytes(optimizer):
        return sum(
            np.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
            for v in optimizer.variables
            if len(v.shape)
        )

    model = _model()
    plain, low = _lso(None), _lso("float8")
    for optimizer in (plain, low):
        optimizer.build(model.trainable_variables)
    weights = sum(np.prod(v.shape) for v in model.trainable_variables)
    assert state_bytes(plain) == 8 * weights and state_bytes(low) == 3 * weights
    for level, dtype in (("O2", "bfloat16"), ("O3", "bfloat16")):
        model = _model()
        model.compile(optimizer=_lso("float8"), loss="mse", amp_level=level, amp_dtype=dtype)
        model.optimizer.build(model.trainable_variables)
        report = keras_mp.speed_report(model, x, level=level, dtype=dtype).summary["bytes"]
        assert report[level]["optimizer"] == state_bytes(model.optimizer), report


def test_a_skipped_step_keeps_the_moments_and_their_scales():
    model, _ = _train("float8", steps=2)
    x, y = _data()
    before = [_numpy(v) for v in model.optimizer.variables] + [_numpy(w) for w in model.weights]
    x[0, 0] = np.nan
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [_numpy(v) for v in model.optimizer.variables] + [_numpy(w) for w in model.weights]
    paths = [v.path for v in model.optimizer.variables] + [w.path for w in model.weights]
    changed = [p for p, b, a in zip(paths, before, after) if not np.array_equal(a, b)]
    assert [p.split("/")[-1] for p in changed] == ["good_steps", "skipped_steps"], changed


def test_saved_reloaded_and_resumed_exactly(tmp_path):
    model, _ = _train("float8", steps=2, amp_level="O2", amp_dtype="bfloat16")
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.moment_dtypes == ("float8", "float16")
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)
    x, y = _data()
    for m in (model, loaded):
        m.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(_numpy(a), _numpy(b), err_msg=a.path)


@settings(max_examples=25, deadline=None)
@given(
    st.one_of(
        st.text(max_size=8).filter(lambda s: s != "float8"),
        st.tuples(
            st.sampled_from(["float8", "int8", "float16"]), st.sampled_from(["float8", "float64"])
        ),
        st.integers(),
    )
)
def test_bad_moment_dtypes_are_refused_by_name(moment_dtypes):
    with pytest.raises(ValueError, match=r"`moment_dtypes` must be None"):
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), moment_dtypes=moment_dtypes)


def test_optimizers_other_than_adam_and_compensated_updates_are_refused():
    with pytest.raises(ValueError, match="must be `keras.optimizers.Adam` or `AdamW`.*SGD"):
        _lso("float8", inner=keras.optimizers.SGD())
    with pytest.raises(ValueError, match="choose one"):
        _lso("float8", master_weights="compensated")
    _lso("float8", inner=keras.optimizers.AdamW())  # AdamW is Adam's step


def _adam_run(moment_dtypes, gradients, size=64):
    """A weight of `size` entries stepped by Adam (beta_2 = 0.999) with
    each gradient in turn (a number for every entry, or a row of `size`),
    its moments in `moment_dtypes` (None: Keras's own float32 Adam); the
    weight at the end."""
    weight = keras.Variable(np.zeros((size,), "float32"))
    optimizer = keras.optimizers.Adam(1e-3, beta_2=0.999)
    if moment_dtypes is not None:
        optimizer = keras_mp.LossScaleOptimizer(
            optimizer, dynamic=False, initial_scale=1.0, moment_dtypes=moment_dtypes
        )
    optimizer.build([weight])
    gradients = np.asarray(gradients, "float32")
    if gradients.ndim == 1:
        gradients = np.repeat(gradients[:, None], size, axis=1)
    if BACKEND == "jax":  # the steps in one compiled scan
        import jax

        def step(state, g):
            weights, slots = state
            weights, slots = optimizer.stateless_apply(slots, [g], weights)
            return (weights, slots), None

        state = ([weight.value], [v.value for v in optimizer.variables])
        (weights, _), _ = jax.jit(lambda s, gs: jax.lax.scan(step, s, gs))(state, gradients)
        return np.asarray(weights[0])
    if BACKEND == "tensorflow":  # the steps in one graph loop
        import tensorflow as tf

        @tf.function
        def steps(gs):
            for g in gs:
                optimizer.apply([g], [weight])

        steps(tf.constant(gradients))
    else:
        for g in gradients:
            optimizer.apply([keras.ops.convert_to_tensor(g)], [weight])
    return keras.ops.convert_to_numpy(weight)


# Issue 63.6's two runs: 50 steps of gradient 1 then 2950 of 0.01 (the
# second moment must decay by 0.1% a step, below bfloat16's half spacing of
# 0.39%), and a gradient drifting from 0.5 to 0.4 over 300 steps (the first
# moment must follow by steps below E4M3's half spacing of 6%).
# And the review's: 3000 steps of a gradient whose noise (std 0.5) is five
# times its mean (0.1), each entry its own.
LONG_RUNS = {
    "decay": [1.0] * 50 + [0.01] * 2950,
    "drift": list(np.linspace(0.5, 0.4, 300)),
    "noisy": 0.1 + 0.5 * np.random.default_rng(1).normal(size=(3000, 64)),
}


@pytest.mark.slow(reason="thousands of Adam steps, the drift a short run cannot show")
@pytest.mark.parametrize("run", list(LONG_RUNS))
@pytest.mark.parametrize("moment_dtypes", [("float8", "bfloat16"), ("float8", "float16")])
def test_every_moment_format_follows_float32_adam_over_thousands_of_steps(moment_dtypes, run):
    """Rounded to nearest, bfloat16's second moment never decayed (the
    weight ended at -0.168 against float32's -0.324) and E4M3's first moment
    stalled; rounded stochastically they follow float32 Adam: the weight
    within 2% of float32 Adam's (each step's rounding is unbiased; its noise
    averages over the run)."""
    gradients = LONG_RUNS[run]
    want = _adam_run(None, gradients)
    got = _adam_run(moment_dtypes, gradients)
    assert abs(np.mean(got) - np.mean(want)) <= 0.02 * abs(np.mean(want)), (got, want)
    # Each entry within 5% (each is one draw of the rounding's noise: the
    # constant runs' entries spread by about 3%; the noisy run's entries
    # each take their own path).
    assert np.linalg.norm(got - want) <= 0.05 * np.linalg.norm(want)


def test_stochastic_rounding_keeps_nan_inf_signs_and_its_grid():
    """NaN stays NaN (a payload's carry made it -0), the sign of a negative
    float32 subnormal is kept (XLA flushes it in `x < 0`), infinities stay,
    and every value lands on its format's grid."""
    from keras_mp._src.optimizer import low_precision_state as lp

    x = np.array(
        [np.nan, -3e-39, -1.5, 0.3, np.inf, -np.inf, 0.0, 1e-3],
        "float32",
    )
    x[0] = np.frombuffer(np.uint32(0x7FFFFFFF).tobytes(), "float32")[0]
    seed = keras.ops.convert_to_tensor(7, "int32")
    for dtype in ("bfloat16", "float16", "uint8"):
        got = np.asarray(keras.ops.convert_to_numpy(lp.stochastic_round(x, dtype, seed)))
        assert np.isnan(got[0]), (dtype, got)
        assert np.signbit(got[1]) and got[2] < 0, (dtype, got)
        assert got[6] == 0.0
        if dtype != "uint8":
            assert got[4] == np.inf and got[5] == -np.inf, (dtype, got)
