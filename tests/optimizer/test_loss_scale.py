"""The loss-scale state machine, against the pure-Python reference.

`update` alone, then the whole optimizer driven by hypothesis: random
configurations and random sequences of finite / inf / nan / huge-but-finite
steps, compared every step (scale, counters, iterations, weights).
"""

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from keras import ops

import keras_mp
from keras_mp._src.optimizer.loss_scale import LossScaleConfig
from keras_mp._src.optimizer.loss_scale import LossScaleState
from keras_mp._src.optimizer.loss_scale import update
from tests.reference import ReferenceLossScale
from tests.reference import reference_sgd_step

# These tests hand the optimizer gradients they scaled themselves, which
# the optimizer's warning of a loss never scaled tells to ignore.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:LossScaleOptimizer\.\w+ was called, but the loss was never scaled"
)

BACKEND = keras.backend.backend()
LEARNING_RATE = 0.5


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _run_update(state, finite, config, as_tensor):
    if as_tensor:
        finite = ops.convert_to_tensor(finite)
    new = update(
        LossScaleState(
            ops.convert_to_tensor(np.float32(state[0])),
            ops.convert_to_tensor(np.int32(state[1])),
            ops.convert_to_tensor(np.int32(state[2])),
        ),
        finite,
        config,
    )
    return float(_numpy(new.scale)), int(_numpy(new.good_steps)), int(_numpy(new.skipped_steps))


@pytest.mark.parametrize(
    "state, finite, expected",
    [
        ((8.0, 0, 0), True, (8.0, 1, 0)),
        ((8.0, 2, 0), True, (16.0, 0, 0)),  # third finite step: grow
        ((8.0, 2, 5), False, (4.0, 0, 6)),
        ((1.0, 1, 0), False, (1.0, 0, 1)),  # floor
        ((64.0, 2, 0), True, (64.0, 0, 0)),  # ceiling
    ],
    ids=["count", "grow", "backoff", "floor", "ceiling"],
)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["static", "tensor"])
def test_update_dynamic(state, finite, expected, as_tensor):
    """Both forms: selects on a tensor, and the folded Python-bool form."""
    config = LossScaleConfig(dynamic_growth_steps=3, min_scale=1.0, max_scale=64.0)
    assert _run_update(state, finite, config, as_tensor) == expected


@pytest.mark.parametrize(
    "state, expected",
    [
        ((1.0, 1, 0), (0.5, 0, 1)),  # below tf.keras 2's floor of 1
        ((2.0**-125, 0, 0), (2.0**-126, 0, 1)),
        ((2.0**-126, 0, 3), (2.0**-126, 0, 4)),  # the smallest normal float32
    ],
    ids=["below_one", "to_smallest_normal", "at_smallest_normal"],
)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["static", "tensor"])
def test_update_without_a_floor_stops_at_the_smallest_normal_float32(state, expected, as_tensor):
    config = LossScaleConfig(dynamic_growth_steps=3, min_scale=None)
    assert _run_update(state, False, config, as_tensor) == expected


@pytest.mark.parametrize("as_tensor", [False, True], ids=["static", "tensor"])
@pytest.mark.parametrize("finite", [True, False])
def test_update_fixed_scale_never_changes(finite, as_tensor):
    config = LossScaleConfig(dynamic=False, dynamic_growth_steps=1)
    scale, good, skipped = _run_update((1000.0, 0, 0), finite, config, as_tensor)
    assert scale == 1000.0
    assert (good, skipped) == ((1, 0) if finite else (0, 1))


TRANSITIONS = [
    # (dynamic, min_scale, state, finite): every branch of `update`, with the bounds.
    (True, 1.0, (8.0, 0, 0), True),  # count
    (True, 1.0, (8.0, 2, 0), True),  # grow
    (True, 1.0, (48.0, 2, 0), True),  # grow to the ceiling
    (True, 1.0, (64.0, 2, 0), True),  # at the ceiling
    (True, 1.0, (8.0, 2, 5), False),  # back off
    (True, 1.0, (1.5, 1, 0), False),  # back off to the floor
    (True, 1.0, (1.0, 0, 3), False),  # at the floor
    (True, None, (1.0, 0, 3), False),  # no floor: below 1
    (True, None, (1.5 * 2.0**-126, 0, 3), False),  # to the smallest normal float32
    (True, None, (2.0**-126, 0, 3), False),  # at it
    (False, 1.0, (1000.0, 5, 0), True),  # fixed: count
    (False, 1.0, (1000.0, 5, 2), False),  # fixed: skip
]


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's in-place form of `update`")
@pytest.mark.parametrize("dynamic, min_scale, state, finite", TRANSITIONS)
def test_torch_in_place_update_agrees_with_update(dynamic, min_scale, state, finite):
    """PyTorch's step updates the state with in-place ops (faster than
    `update` through `keras.ops`): the same transition, every branch."""
    from keras_mp._src.backends import torch as torch_backend
    from keras_mp._src.optimizer.loss_scale import Step

    config = LossScaleConfig(
        dynamic=dynamic, dynamic_growth_steps=3, min_scale=min_scale, max_scale=64.0
    )
    variables = [
        keras.Variable(value, dtype=dtype, trainable=False)
        for value, dtype in zip(state, ("float32", "int32", "int32"))
    ]
    step = Step(*[None] * len(Step._fields))._replace(config=config, variables=variables)
    torch_backend.update_in_place(step, finite)
    in_place = (float(_numpy(variables[0])), int(_numpy(variables[1])), int(_numpy(variables[2])))
    assert in_place == _run_update(state, finite, config, as_tensor=False)
    assert in_place == _run_update(state, finite, config, as_tensor=True)


# -- the optimizer against the reference, step by step ------------------------

STEP_KINDS = ("finite", "finite", "finite", "inf", "-inf", "nan", "huge")


def _gradient(kind, scale, rng):
    """The gradients of a scaled loss: `true_grad * scale`, or a bad one."""
    true_grad = rng.standard_normal(4).astype(np.float32) * np.float32(0.01)
    g = (true_grad * np.float32(scale)).astype(np.float32)
    if kind == "inf":
        g[rng.integers(4)] = np.inf
    elif kind == "-inf":
        g[rng.integers(4)] = -np.inf
    elif kind == "nan":
        g[rng.integers(4)] = np.nan
    elif kind == "huge":
        # Finite values whose sum overflows float32: still a finite step.
        g[:2] = np.float32(3e38)
    return g


dynamic_configs = st.fixed_dictionaries(
    {
        "dynamic": st.just(True),
        "initial_scale": st.sampled_from([1.0, 3.0, 2.0**10, 2.0**15, 1000.0]),
        "dynamic_growth_steps": st.integers(1, 4),
        "growth_factor": st.sampled_from([2.0, 4.0, 1.5, 3.0]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.3]),
        "min_scale": st.sampled_from([None, 1.0, 0.5, 3.0]),
        "max_scale": st.sampled_from([2.0**12, 2.0**16, 5000.0]),
    }
).filter(lambda c: (c["min_scale"] or 0.0) <= c["initial_scale"] <= c["max_scale"])
fixed_configs = st.fixed_dictionaries(
    {
        "dynamic": st.just(False),
        "initial_scale": st.sampled_from([1.0, 128.0, 1000.0]),
        "skip_on_overflow": st.booleans(),
    }
)


@settings(
    max_examples=15,
    deadline=None,
    # jax_skip_form only sets which form JAX's skip takes, for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(
    config=st.one_of(dynamic_configs, fixed_configs),
    kinds=st.lists(st.sampled_from(STEP_KINDS), min_size=1, max_size=14),
    seed=st.integers(0, 2**16),
)
def test_optimizer_follows_reference(config, kinds, seed, jax_skip_form):
    rng = np.random.default_rng(seed)
    reference = ReferenceLossScale(**config)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(LEARNING_RATE), **config)
    variable = keras.Variable(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    optimizer.build([variable])
    weights = [_numpy(variable)]
    for step, kind in enumerate(kinds):
        if not reference.dynamic and not reference.skip_on_overflow and kind != "finite":
            kind = "finite"  # unchecked steps with inf would only poison weights
        grad = _gradient(kind, reference.scale, rng)
        scale_before = reference.scale
        applied = reference.step([grad])
        if applied:
            weights = reference_sgd_step(weights, [grad], scale_before, LEARNING_RATE)
        optimizer.apply([ops.convert_to_tensor(grad)], [variable])

        where = f"step {step} ({kind}) of {kinds} with {config}"
        assert float(_numpy(optimizer.loss_scale)) == reference.scale, where
        assert int(_numpy(optimizer.good_steps)) == reference.good_steps, where
        assert int(_numpy(optimizer.skipped_steps)) == reference.skipped_steps, where
        assert int(_numpy(optimizer.iterations)) == reference.iterations, where
        if BACKEND != "tensorflow":
            # torch's SGD and XLA (JAX) contract `w - lr * g` into a fused
            # multiply-add: equal to within float32 rounding. The state above
            # is exact everywhere.
            np.testing.assert_allclose(_numpy(variable), weights[0], rtol=1e-6, err_msg=where)
        else:
            np.testing.assert_array_equal(_numpy(variable), weights[0], err_msg=where)


@pytest.mark.parametrize("min_scale", [None, 1.0], ids=["no_floor", "min_scale_1"])
def test_scale_never_collapses(min_scale, jax_skip_form):
    """Keras 3.15's built-in (and torch.amp's GradScaler) reach 0.0 after
    about 160 overflows in a row, and a scale of 0 never comes back. Without
    a floor keras_mp's stops at the smallest normal float32; with one, there."""
    reference = ReferenceLossScale(dynamic_growth_steps=2, min_scale=min_scale)
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic_growth_steps=2, min_scale=min_scale
    )
    variable = keras.Variable(np.ones(3, np.float32))
    optimizer.build([variable])
    bad = ops.convert_to_tensor(np.array([np.inf, 1.0, 1.0], np.float32))
    for _ in range(300):
        optimizer.apply([bad], [variable])
        reference.step([_numpy(bad)])
    floor = np.float32(2.0**-126) if min_scale is None else np.float32(min_scale)
    assert reference.scale == floor
    assert float(_numpy(optimizer.loss_scale)) == floor
    assert int(_numpy(optimizer.skipped_steps)) == 300
    # A gradient of 1 scaled by the floor is unscaled to 1; two finite steps
    # grow the scale off the floor.
    good = np.full(3, floor, np.float32)
    for _ in range(2):
        optimizer.apply([ops.convert_to_tensor(good)], [variable])  # unscaled in place on torch
        reference.step([good])
    np.testing.assert_allclose(_numpy(variable), np.full(3, np.float32(0.8)), rtol=1e-6)
    assert float(_numpy(optimizer.loss_scale)) == reference.scale == 2 * floor
