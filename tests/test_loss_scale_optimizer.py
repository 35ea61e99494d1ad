"""LossScaleOptimizer: construction, skipping, unscaling, interplay with the
inner optimizer's features, serialization, custom training loops."""

import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from keras import ops

import keras_mp
from keras_mp._src import backends

# These tests hand the optimizer gradients they scaled themselves, which
# the optimizer's warning of a loss never scaled tells to ignore.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:LossScaleOptimizer\.\w+ was called, but the loss was never scaled"
)

BACKEND = keras.backend.backend()
# TensorFlow's XLA step as compiled for a CPU: on a GPU the skip is selects
# (`keep_conditional`) and the tensors live in the GPU's memory.
tensorflow_xla_on_cpu = pytest.mark.skipif(
    BACKEND != "tensorflow" or bool(backends.current.gpu_compute_capability()),
    reason="TensorFlow's XLA step on a CPU",
)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _tensor(values, dtype="float32"):
    return ops.convert_to_tensor(np.asarray(values, dtype=dtype))


def _snapshot(optimizer, variables):
    return [_numpy(v).copy() for v in list(variables) + list(optimizer.variables)]


# -- the public surface ---------------------------------------------------------


def test_public_names():
    assert set(keras_mp.__all__) == {
        "ALLOW_LIST",
        "DENY_LIST",
        "HALF_DTYPES",
        "LEVELS",
        "LossScaleOptimizer",
        "analyze",
        "apply_amp",
        "callbacks",
        "compile",
        "export",
        "precision_summary",
        "serving_copy",
        "to_float",
    }
    for name in keras_mp.__all__:
        assert getattr(keras_mp, name) is not None


def test_is_a_keras_loss_scale_optimizer():
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer, keras.optimizers.Optimizer)


def test_compile_does_not_wrap_twice():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=optimizer, loss="mse")
    assert model.optimizer is optimizer


def test_keras_attribute_names_alias_the_state():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=8.0, dynamic_growth_steps=3
    )
    assert optimizer.dynamic_scale is optimizer.loss_scale
    assert optimizer.step_counter is optimizer.good_steps
    assert optimizer.initial_scale == 8.0
    assert optimizer.dynamic_growth_steps == 3
    names = [v.path.split("/")[-1] for v in optimizer.variables]
    for name in ("loss_scale", "good_steps", "skipped_steps"):
        assert name in names
    assert float(_numpy(optimizer.scale_loss(2.0))) == 16.0


def test_learning_rate_is_the_inner_one():
    inner = keras.optimizers.SGD(0.25)
    optimizer = keras_mp.LossScaleOptimizer(inner)
    assert float(_numpy(optimizer.learning_rate)) == 0.25
    optimizer.learning_rate = 0.5
    assert float(_numpy(inner.learning_rate)) == 0.5


# -- bad arguments -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"initial_scale": 0.0}, ValueError, "initial_scale=0.0"),
        ({"initial_scale": -1.0}, ValueError, "initial_scale=-1.0"),
        ({"initial_scale": float("inf")}, ValueError, "initial_scale=inf"),
        ({"initial_scale": 2.0**127, "dynamic": False}, ValueError, "at most 2**126"),
        ({"max_scale": 1e38}, ValueError, "max_scale=1e+38"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor=1.0"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor=1.0"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor=0.0"),
        (
            {"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 3.0},
            ValueError,
            "min_scale=4.0, max_scale=2.0",
        ),
        ({"min_scale": 0.0}, ValueError, "min_scale=0.0"),
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps=0"),
        ({"dynamic_growth_steps": 2.5}, ValueError, "dynamic_growth_steps=2.5"),
        ({"skip_on_overflow": False}, ValueError, "skip_on_overflow=False"),
        ({"dynamic": "yes"}, TypeError, "dynamic='yes'"),
        ({"dynamic": 1024.0}, TypeError, "pass `initial_scale=` by keyword"),
        ({"initial_scale": 2.0**30}, ValueError, "initial_scale=1073741824.0"),
        ({"clipnorm": 1.0}, ValueError, "set `clipnorm` on the `inner_optimizer`"),
        ({"foo": 1}, ValueError, "arguments: `foo`"),
        ({"master_weights": "yes"}, ValueError, "master_weights='yes'"),
        ({"master_weights": None}, TypeError, "master_weights=None"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, fragment):
    with pytest.raises(error, match=f"Received:.*{_escape(fragment)}|{_escape(fragment)}") as info:
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    assert fragment in str(info.value)


def _escape(text):
    import re

    return re.escape(text)


def test_bad_inner_optimizer():
    with pytest.raises(
        TypeError,
        match="`inner_optimizer` must be a `keras.optimizers.Optimizer`.*"
        "Received: inner_optimizer='adam'",
    ):
        keras_mp.LossScaleOptimizer("adam")
    inner = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        keras_mp.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        keras_mp.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


@settings(max_examples=60, deadline=None)
@given(
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.none(),
        st.booleans(),
    ),
    argument=st.sampled_from(
        [
            "initial_scale",
            "growth_factor",
            "backoff_factor",
            "min_scale",
            "max_scale",
            "dynamic_growth_steps",
        ]
    ),
)
def test_any_value_is_accepted_or_refused_by_name(argument, value):
    """Bad input never gets through silently and is always named."""
    try:
        optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), **{argument: value})
    except (ValueError, TypeError) as e:
        assert f"`{argument}`" in str(e) or argument in str(e)
        return
    config = optimizer.get_config()
    if value is None:  # tf.keras 2's "the default"
        assert (
            config[argument] == {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}[argument]
        )
        return
    assert config[argument] == value
    assert optimizer.min_scale <= optimizer.initial_scale <= optimizer.max_scale
    assert optimizer.growth_factor > 1 and 0 < optimizer.backoff_factor < 1


# -- skipping ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_skipped_step_leaves_everything_bit_identical(bad, jax_skip_form):
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    variables = [
        keras.Variable(np.arange(4, dtype=np.float32)),
        keras.Variable(np.ones((2, 2), np.float32)),
    ]
    optimizer.build(variables)
    good = [_tensor([1.0, -2.0, 3.0, 4.0]), _tensor([[1.0, 2.0], [3.0, 4.0]])]
    optimizer.apply(good, variables)  # non-zero slots
    before = _snapshot(optimizer, variables)
    iterations = int(_numpy(optimizer.iterations))
    optimizer.apply([good[0], _tensor([[1.0, bad], [3.0, 4.0]])], variables)
    after = _snapshot(optimizer, variables)
    state_paths = {"loss_scale", "good_steps", "skipped_steps"}
    names = [v.path.split("/")[-1] for v in variables] + [
        v.path.split("/")[-1] for v in optimizer.variables
    ]
    for name, b, a in zip(names, before, after):
        if name not in state_paths:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert int(_numpy(optimizer.iterations)) == iterations
    assert int(_numpy(optimizer.skipped_steps)) == 1
    assert float(_numpy(optimizer.loss_scale)) == 2.0


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's two forms of the skip")
def test_jax_skip_form_follows_the_platform(monkeypatch):
    import jax

    monkeypatch.delenv("KERAS_MP_JAX_SKIP_FORM", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not backends.current.skips_by_select()
    for platform in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        assert backends.current.skips_by_select()
    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "cond")  # the documented switch
    assert not backends.current.skips_by_select()
    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "sometimes")
    with pytest.raises(ValueError, match="KERAS_MP_JAX_SKIP_FORM='sometimes'"):
        backends.current.skips_by_select()


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's two forms of the skip")
def test_jax_select_form_has_no_conditional(jax_skip_form):
    """A GPU waits for the device at each `cond`: the select form has none."""
    import jax

    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    variables = [
        keras.Variable(np.ones((2, 2), np.float32)),
        keras.Variable(np.ones(2, np.float32)),
    ]
    optimizer.build(variables)
    grads = [_tensor(np.ones((2, 2))), _tensor(np.ones(2))]
    jaxpr = str(
        jax.make_jaxpr(optimizer.stateless_apply)(
            [v.value for v in optimizer.variables], grads, [v.value for v in variables]
        )
    )
    assert ("cond[" in jaxpr) == (jax_skip_form == "cond"), jaxpr


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's select form of the skip")
@pytest.mark.parametrize(
    "master_weights",
    [
        False,
        # Left: the master copy and the half weight are still copied once
        # (the copy is chosen after its reconciliation, in a second select).
        pytest.param(True, marks=pytest.mark.xfail(strict=True, reason="copies the master")),
    ],
)
def test_jax_select_form_copies_no_slot(monkeypatch, master_weights):
    """The select form updates the slots in place, as the plain step does.

    Selected only after the inner optimizer's update, the weight update
    recomputed Adam's new moments from the old ones while the moments were
    written in place: XLA copied every moment buffer first, a read and a
    write of the optimizer's state per step (`benchmarks/hlo_census.py`).
    """
    import jax

    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "select")
    dtype = "float16" if master_weights else "float32"
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(0.1), master_weights=master_weights
    )
    variables = [keras.Variable(np.ones((64, 32)), dtype=dtype), keras.Variable(np.ones(32))]
    optimizer.build(variables)
    grads = [_tensor(np.ones((64, 32)), dtype), _tensor(np.ones(32))]

    def apply(optimizer_values, grads, trainable_values):
        # Outputs in the donated inputs' order, as Keras's trainer has them.
        new_trainable, new_optimizer = optimizer.stateless_apply(
            optimizer_values, grads, trainable_values
        )
        return new_optimizer, new_trainable

    step = jax.jit(apply, donate_argnums=(0, 2))
    hlo = (
        step.lower([v.value for v in optimizer.variables], grads, [v.value for v in variables])
        .compile()
        .as_text()
    )
    entry = hlo[hlo.index("ENTRY") :]
    copies = [line for line in entry.splitlines() if " copy(" in line and "[64,32]" in line]
    assert not copies, "\n".join(copies)


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_step_keeps_the_skip_a_conditional():
    """XLA would turn the skip into selects: the update on every step, and a
    copy of every weight and slot first. The compiled step must keep a conditional,
    copy no slot outside the overflow branch, and still skip exactly."""
    import tensorflow as tf

    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    variables = [
        keras.Variable(np.ones((64, 32), np.float32)),
        keras.Variable(np.ones(32, np.float32)),
    ]
    optimizer.build(variables)

    @tf.function(jit_compile=True)
    def step(grads):
        optimizer.apply(grads, variables)

    good = [_tensor(np.ones((64, 32))), _tensor(np.ones(32))]
    hlo = step.experimental_get_compiler_ir(good)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert " conditional(" in entry
    copies = [line for line in entry.splitlines() if " copy(" in line and "[] copy(" not in line]
    assert not [line for line in copies if "f32[64,32]" in line], copies

    step(good)
    before = _snapshot(optimizer, variables)
    step([good[0], _tensor(np.full(32, np.nan))])
    after = _snapshot(optimizer, variables)
    state = {"loss_scale", "good_steps", "skipped_steps"}
    for variable, b, a in zip(variables + list(optimizer.variables), before, after):
        if variable.path.split("/")[-1] not in state:
            np.testing.assert_array_equal(a, b, err_msg=variable.path)
    assert int(_numpy(optimizer.skipped_steps)) == 1


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_check_of_float32_gradients_reads_them_once():
    """Under XLA the float32 check is a sum of each gradient; the elementwise
    `all(isfinite(g))` (an elementwise pass written out, then a separate
    reduction on XLA's CPU backend) runs only in the conditional's branch for a non-finite sum."""
    import tensorflow as tf

    check = tf.function(backends.current.all_finite, jit_compile=True)
    grads = [_tensor(np.ones((64, 32))), _tensor(np.ones(32))]
    hlo = check.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert " conditional(" in entry
    assert "pred[64,32]" not in entry, entry
    assert bool(_numpy(check(grads)))
    assert not bool(_numpy(check([grads[0], _tensor([1.0] * 31 + [np.nan])])))
    assert bool(_numpy(check([_tensor(np.full((64, 32), 3e38)), grads[1]])))


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_check_of_float16_gradients_reduces_rows_of_eight():
    """XLA's CPU backend reduces `isfinite` over rows of 8 values about twice
    as fast as over a layer's own shape; sizes that are not a multiple of 8 keep theirs."""
    import tensorflow as tf

    check = tf.function(backends.current.all_finite, jit_compile=True)
    grads = [_tensor(np.ones((64, 32)), "float16"), _tensor(np.ones(31), "float16")]
    hlo = check.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert "= pred[256,8]" in entry and "= pred[64,32]" not in entry, entry
    assert bool(_numpy(check(grads)))
    for bad in (np.nan, np.inf, -np.inf):
        values = np.ones((64, 32))
        values[63, 31] = bad
        assert not bool(_numpy(check([_tensor(values, "float16"), grads[1]])))
        assert not bool(_numpy(check([grads[0], _tensor([1.0] * 30 + [bad], "float16")])))


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_step_takes_half_precision_gradients_into_the_conditional_narrow():
    """Gradients cast up from float16 (a mixed policy's) must not be written
    out as float32 before the conditional (one more pass over every
    gradient); the step must still equal
    the one without XLA and skip a float16 nan."""
    import tensorflow as tf

    def make():
        optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
        variables = [
            keras.Variable(np.ones((64, 32), np.float32)),
            keras.Variable(np.ones(32, np.float32)),
        ]
        optimizer.build(variables)
        return optimizer, variables

    optimizer, variables = make()
    reference_optimizer, reference_variables = make()

    def apply(opt, vs, half_grads):
        opt.apply([tf.cast(g, "float32") for g in half_grads], vs)

    step = tf.function(lambda grads: apply(optimizer, variables, grads), jit_compile=True)
    reference = tf.function(lambda grads: apply(reference_optimizer, reference_variables, grads))
    rng = np.random.default_rng(0)
    good = [_tensor(rng.normal(size=(64, 32)), "float16"), _tensor(rng.normal(size=32), "float16")]
    hlo = step.experimental_get_compiler_ir(good)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    widened = [
        line
        for line in entry.splitlines()
        if "= f32[64,32]" in line and (" fusion(" in line or " convert(" in line)
    ]
    assert " conditional(" in entry
    assert not widened, widened

    for grads in (good, good, [good[0], _tensor(np.full(32, np.nan), "float16")], good):
        step(grads)
        reference(grads)
        for a, b in zip(
            _snapshot(optimizer, variables), _snapshot(reference_optimizer, reference_variables)
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(_numpy(optimizer.skipped_steps)) == 1
    assert int(_numpy(optimizer.iterations)) == 3


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_narrow_origins_leaves_other_gradients_alone():
    grads = [_tensor([1.0, 2.0]), None]
    assert backends.current.narrow_origins(grads) == grads
    assert backends.current.widen(grads, grads) == grads


def test_fixed_scale_without_skipping_applies_every_step():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=2.0, skip_on_overflow=False
    )
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer.apply([_tensor([np.inf, 2.0])], [variable])
    np.testing.assert_array_equal(_numpy(variable), [-np.inf, -1.0])
    assert int(_numpy(optimizer.iterations)) == 1
    assert int(_numpy(optimizer.skipped_steps)) == 0
    assert float(_numpy(optimizer.loss_scale)) == 2.0


def test_fixed_scale_skips_but_keeps_the_scale():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=1024.0
    )
    variable = keras.Variable(np.zeros(2, np.float32))
    for _ in range(3):
        optimizer.apply([_tensor([np.nan, 2.0])], [variable])
    optimizer.apply([_tensor([1024.0, 2048.0])], [variable])
    np.testing.assert_array_equal(_numpy(variable), [-1.0, -2.0])
    assert float(_numpy(optimizer.loss_scale)) == 1024.0
    assert int(_numpy(optimizer.skipped_steps)) == 3


# -- the finiteness check --------------------------------------------------------


@pytest.mark.parametrize(
    "grads, expected",
    [
        ([[1.0, 2.0], [3.0]], True),
        ([[3e38, 3e38], [3e38]], True),  # the sum overflows, the values do not
        ([[1.0, np.inf], [3.0]], False),
        ([[1.0, 2.0], [-np.inf]], False),
        ([[np.nan, 2.0], [3.0]], False),
        ([[np.inf, -np.inf], [3.0]], False),  # the sum would be nan anyway
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_all_finite_is_exact(grads, expected, dtype, mode):
    """bfloat16 has float32's range: its float32 sums overflow as float32's do."""
    if dtype == "float16":
        grads = [[min(v, 6e4) if np.isfinite(v) else v for v in g] for g in grads]
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    tensors = [_tensor(g, dtype) for g in grads] + [None]
    check = _compiled(
        backends.current.all_finite, COMPILE_MODES[-1] if mode == "compiled" else mode
    )
    assert bool(_numpy(check(tensors))) is expected


def test_all_finite_mixed_dtypes():
    grads = [_tensor([1.0], "float16"), _tensor([np.inf], "float32")]
    assert not bool(_numpy(backends.current.all_finite(grads)))
    grads = [_tensor([np.inf], "float16"), _tensor([1.0], "float32")]
    assert not bool(_numpy(backends.current.all_finite(grads)))


def _compiled(fn, mode):
    """`fn` as `fit` runs it: eager, or traced by the backend's compiler."""
    if mode == "eager":
        return fn
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=(mode == "xla"))


COMPILE_MODES = {
    "tensorflow": ["eager", "graph", "xla"],
    "jax": ["eager", "jit"],
    "torch": ["eager"],
}[BACKEND]

_SHAPES = [(), (0,), (3,), (1, 5), (4, 3), (2, 3, 2), (3, 3, 2, 4)]


@st.composite
def _gradient_lists(draw):
    dtype = draw(st.sampled_from(["float32", "float16"]))
    big = np.finfo(dtype).max
    grads = []
    for shape in draw(st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=4)):
        size = int(np.prod(shape))
        values = draw(
            st.lists(
                st.one_of(
                    st.floats(-4.0, 4.0, width=16),
                    st.sampled_from([np.inf, -np.inf, np.nan, big, -big]),
                ),
                min_size=size,
                max_size=size,
            )
        )
        grads.append(np.asarray(values, dtype).reshape(shape))
    return grads


@pytest.mark.parametrize("mode", COMPILE_MODES)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(grads=_gradient_lists())
# The sum of finite values overflows: still finite (the exact check decides).
@example(grads=[np.full((4, 3), np.finfo("float32").max, "float32")])
@example(grads=[np.full((2, 3, 2), -3e38, "float32"), np.full((3,), 3e38, "float32")])
@example(grads=[np.full((4, 3), 3e38, "float32"), np.array([1.0, np.nan], "float32")])
def test_all_finite_matches_numpy(mode, grads):
    """Any shapes, dtypes and values, eager and compiled: numpy's answer.

    Sums of the largest finite values overflow; the answer must not change.
    """
    expected = all(np.all(np.isfinite(g)) for g in grads)
    check = _compiled(lambda gs: backends.current.all_finite(gs), mode)
    tensors = [ops.convert_to_tensor(g) for g in grads]
    assert bool(_numpy(check(tensors))) is expected


# -- unscaling -------------------------------------------------------------------


def test_unscaling_is_float32_for_float16_gradients():
    """A scale above float16's max (65504) must not become inf in the division."""
    variable = keras.Variable(np.zeros(2, np.float16), dtype="float16")
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=2.0**20, max_scale=2.0**24
    )
    # The true gradient 2**-10 scaled by 2**20 is 1024, representable in float16.
    optimizer.apply([_tensor([1024.0, 2048.0], "float16")], [variable])
    np.testing.assert_array_equal(_numpy(variable), np.array([-(2.0**-10), -(2.0**-9)], np.float16))


def test_unscaled_gradient_reaches_clipping():
    """clipnorm on the inner optimizer sees the unscaled gradient."""
    inner = keras.optimizers.SGD(1.0, clipnorm=1.0)
    optimizer = keras_mp.LossScaleOptimizer(inner, initial_scale=2.0**10)
    variable = keras.Variable(np.zeros(2, np.float32))
    # Unscaled: [0.3, 0.4], norm 0.5 < 1: no clipping. Scaled: norm 512.
    optimizer.apply([_tensor([0.3 * 1024, 0.4 * 1024])], [variable])
    np.testing.assert_allclose(_numpy(variable), [-0.3, -0.4], rtol=1e-6)
    # Unscaled [3, 4], norm 5: clipped to norm 1.
    optimizer.apply([_tensor([3.0 * 1024, 4.0 * 1024])], [variable])
    np.testing.assert_allclose(_numpy(variable), [-0.9, -1.2], rtol=1e-6)


@pytest.mark.parametrize(
    "clip, expected",
    [({"global_clipnorm": 1.0}, [-0.6, -0.8]), ({"clipvalue": 2.0}, [-2.0, -0.5])],
)
def test_other_clipping_sees_unscaled_gradients(clip, expected):
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(1.0, **clip), initial_scale=256.0)
    variable = keras.Variable(np.zeros(2, np.float32))
    grad = [3.0, 0.5] if "clipvalue" in clip else [3.0, 4.0]
    optimizer.apply([_tensor(np.array(grad) * 256.0)], [variable])
    np.testing.assert_allclose(_numpy(variable), expected, rtol=1e-6)


def test_gradient_accumulation_drops_only_the_bad_micro_batch(jax_skip_form):
    inner = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer = keras_mp.LossScaleOptimizer(inner, initial_scale=4.0, dynamic_growth_steps=100)
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer.build([variable])
    optimizer.apply([_tensor([4.0, 8.0])], [variable])  # accumulated: [1, 2]
    np.testing.assert_array_equal(_numpy(variable), [0.0, 0.0])
    optimizer.apply([_tensor([np.nan, 8.0])], [variable])  # dropped
    np.testing.assert_array_equal(_numpy(variable), [0.0, 0.0])
    # The scale is now 2; this micro-batch is [3, 4] unscaled.
    optimizer.apply([_tensor([6.0, 8.0])], [variable])
    np.testing.assert_array_equal(_numpy(variable), [-2.0, -3.0])  # mean of [1,2],[3,4]
    assert int(_numpy(optimizer.iterations)) == 1
    assert int(_numpy(optimizer.skipped_steps)) == 1


# -- serialization -------------------------------------------------------------


def test_config_round_trips_every_argument():
    inner = keras.optimizers.SGD(learning_rate=0.3, momentum=0.5)
    arguments = dict(
        dynamic=True,
        initial_scale=48.0,
        dynamic_growth_steps=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=1000.0,
        skip_on_overflow=True,
        master_weights=False,
        name="my_lso",
    )
    optimizer = keras_mp.LossScaleOptimizer(inner, **arguments)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert type(restored) is keras_mp.LossScaleOptimizer
    config = restored.get_config()
    for key, value in arguments.items():
        assert config[key] == value, key
    assert config["inner_optimizer"]["config"]["momentum"] == 0.5
    assert restored.get_config() == optimizer.get_config()

    fixed = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=100.0, skip_on_overflow=False
    )
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(fixed))
    assert restored.get_config() == fixed.get_config()
    assert restored.dynamic is False and restored.skip_on_overflow is False


def test_state_is_saved_with_the_model(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=64.0, dynamic_growth_steps=3
    )
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((4, 2), np.float32)
    model.fit(x, np.ones((4, 1)), batch_size=2, epochs=1, verbose=0)
    model.fit(np.full((2, 2), np.nan, np.float32), np.ones((2, 1)), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, keras_mp.LossScaleOptimizer)
    for name in ("loss_scale", "good_steps", "skipped_steps", "iterations"):
        assert _numpy(getattr(loaded.optimizer, name)) == _numpy(getattr(optimizer, name)), name
    assert float(_numpy(loaded.optimizer.loss_scale)) == 32.0
    assert int(_numpy(loaded.optimizer.skipped_steps)) == 1


# -- custom training loops -----------------------------------------------------


def _loop_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _loop_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


def _reference_weights_after_one_sgd_step(x, y):
    """float64 reference of one SGD(0.1) step on the mean squared error."""
    model = _loop_model()
    kernel, bias = (w.astype(np.float64) for w in model.get_weights())
    error = x @ kernel + bias - y
    d = 2.0 * error / error.size
    return [kernel - 0.1 * (x.T @ d), bias - 0.1 * d.sum(0)]


def _check_loop_result(model, x, y):
    expected = _reference_weights_after_one_sgd_step(x, y)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.GradientTape loop")
@pytest.mark.parametrize("api", ["keras3", "tf_keras2"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_custom_loop_tensorflow(api, graph):
    import tensorflow as tf

    x, y = _loop_data()
    model = _loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled = (
                optimizer.scale_loss(loss) if api == "keras3" else optimizer.get_scaled_loss(loss)
            )
        grads = tape.gradient(scaled, model.trainable_variables)
        if api == "keras3":
            optimizer.apply(grads, model.trainable_variables)
        else:
            grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

    (tf.function(step) if graph else step)(x, y)
    _check_loop_result(model, x, y)
    assert int(_numpy(optimizer.iterations)) == 1


@pytest.mark.skipif(BACKEND != "jax", reason="jax.grad loop")
@pytest.mark.parametrize("jit", [False, True])
def test_custom_loop_jax_stateless(jit):
    import jax

    x, y = _loop_data()
    model = _loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
    optimizer.build(model.trainable_variables)

    def loss_fn(trainable, optimizer_values, x, y):
        pred, _ = model.stateless_call(trainable, [], x)
        loss = jax.numpy.mean(jax.numpy.square(pred - y))
        scale = optimizer_values[
            [id(v) for v in optimizer.variables].index(id(optimizer.loss_scale))
        ]
        return loss * scale

    def train_step(trainable, optimizer_values, x, y):
        grads = jax.grad(loss_fn)(trainable, optimizer_values, x, y)
        return optimizer.stateless_apply(optimizer_values, grads, trainable)

    step = jax.jit(train_step) if jit else train_step
    trainable, optimizer_values = step(
        [v.value for v in model.trainable_variables], [v.value for v in optimizer.variables], x, y
    )
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    _check_loop_result(model, x, y)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit loop")
@pytest.mark.parametrize("scope", [True, False], ids=["stateless_scope", "no_scope"])
def test_jitted_jax_loop_scales_by_the_steps_own_scale(scope):
    """Under `jax.jit` the scale must come from the step's optimizer values
    (a StatelessScope, as Keras's JAX step and the README's example do); read
    from the variable it is a constant of the trace, which keras_mp says."""
    import jax

    x, y = _loop_data()
    model = _loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
    optimizer.build(model.trainable_variables)

    def loss_fn(trainable, optimizer_values):
        pred, _ = model.stateless_call(trainable, [], x)
        loss = jax.numpy.mean(jax.numpy.square(pred - y))
        if not scope:
            return optimizer.scale_loss(loss)
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_values))):
            return optimizer.scale_loss(loss)

    @jax.jit
    def train_step(trainable, optimizer_values):
        grads = jax.grad(loss_fn)(trainable, optimizer_values)
        return optimizer.stateless_apply(optimizer_values, grads, trainable)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainable, _ = train_step(
            [v.value for v in model.trainable_variables], [v.value for v in optimizer.variables]
        )
    told = [str(w.message) for w in caught if "StatelessScope" in str(w.message)]
    assert len(told) == (0 if scope else 1)
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    _check_loop_result(model, x, y)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's fit")
def test_jax_train_step_scaling_outside_its_state_is_told_how():
    """Inside JAX's `fit` the optimizer's variables hold no value (the step
    carries the state): `scale_loss` outside a StatelessScope says how to
    scale, instead of Keras's "'NoneType' object is not callable"."""
    import jax

    class Unmapped(keras.Model):
        def train_step(self, state, data):
            trainables, non_trainables, optimizer_variables, metrics_variables = state
            x, y = data

            def loss_fn(trainables):
                y_pred, _ = self.stateless_call(trainables, non_trainables, x, training=True)
                return self.optimizer.scale_loss(self.compute_loss(x, y, y_pred))

            grads = jax.grad(loss_fn)(trainables)
            trainables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainables
            )
            return {}, (trainables, non_trainables, optimizer_variables, metrics_variables)

    x, y = _loop_data()
    inputs = keras.Input((3,))
    model = Unmapped(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", amp_level="O2")
    with pytest.raises(ValueError, match=r"(?s)inside `fit`.*keras.StatelessScope\(state_mapping"):
        model.fit(x, y, verbose=0)


@pytest.mark.skipif(BACKEND != "jax", reason="eager apply on JAX")
def test_custom_loop_jax_apply():
    import jax

    x, y = _loop_data()
    model = _loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)

    def loss_fn(trainable):
        pred, _ = model.stateless_call(trainable, [], x)
        return optimizer.scale_loss(jax.numpy.mean(jax.numpy.square(pred - y)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager: the variable's scale is the step's
        grads = jax.grad(loss_fn)([v.value for v in model.trainable_variables])
        optimizer.apply(grads, model.trainable_variables)
    _check_loop_result(model, x, y)


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="eager apply on JAX")
def test_eager_apply_on_jax_compiles_its_step_once(jax_skip_form):
    """Eagerly, the skip's `lax.cond` would be traced and compiled at every
    call; `apply` compiles the step once, and
    its results are those of the same steps run op by op (to a float32
    rounding: XLA may fuse Adam's arithmetic differently)."""
    import jax

    def optimizer_and_variable():
        optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=16.0)
        variable = keras.Variable(np.linspace(-1.0, 1.0, 3).astype(np.float32))
        optimizer.build([variable])
        return optimizer, variable

    optimizer, variable = optimizer_and_variable()
    reference, reference_variable = optimizer_and_variable()
    traced = []
    check_finite = optimizer.check_finite
    optimizer.check_finite = lambda grads: traced.append(1) or check_finite(grads)
    good = _tensor(np.array([3.0, -2.0, 0.5]))
    bad = _tensor(np.array([np.inf, 1.0, 1.0]))
    for grad in [good, bad, good, bad, bad, good]:
        optimizer.apply([grad], [variable])
        with jax.disable_jit():  # every op on its own, `cond` as a Python `if`
            reference.apply([grad], [reference_variable])
    assert len(traced) == 1
    np.testing.assert_allclose(_numpy(variable), _numpy(reference_variable), rtol=1e-6)
    for slot, reference_slot in zip(optimizer.variables, reference.variables):
        np.testing.assert_allclose(
            _numpy(slot), _numpy(reference_slot), rtol=1e-6, err_msg=slot.path
        )
    assert int(_numpy(optimizer.skipped_steps)) == 3
    assert int(_numpy(optimizer.iterations)) == 3
    assert float(_numpy(optimizer.loss_scale)) == 2.0


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="eager check on JAX")
def test_eager_check_finite_on_jax_traces_its_cond_once(monkeypatch):
    """`check_finite` called eagerly: the `cond` of its exact fallback is
    traced once per shape, not compiled again at every call."""
    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "cond")
    traces = backends.current.TRACE_COUNTS["exact_all_finite"]
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    # Shapes no other test uses: JAX caches a trace per function and shapes.
    finite = [_tensor(np.ones((13, 3))), _tensor(np.ones(3))]
    nan = [_tensor(np.ones((13, 3))), _tensor(np.array([1.0, np.nan, 1.0]))]
    huge = [_tensor(np.full((13, 3), 3e38)), _tensor(np.ones(3))]  # its sum overflows
    answers = [
        bool(_numpy(optimizer.check_finite(g))) for g in [finite, nan, huge, finite, nan, huge]
    ]
    assert answers == [True, False, True] * 2
    assert backends.current.TRACE_COUNTS["exact_all_finite"] == traces + 1


@pytest.mark.skipif(BACKEND != "torch", reason="loss.backward() loop")
@pytest.mark.parametrize("api", ["keras3", "tf_keras2"])
def test_custom_loop_torch(api):
    import torch

    x, y = _loop_data()
    model = _loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
    loss = torch.mean(
        torch.square(model(x) - keras.ops.convert_to_tensor(y))
    )  # on the model's device
    scaled = optimizer.scale_loss(loss) if api == "keras3" else optimizer.get_scaled_loss(loss)
    model.zero_grad()
    scaled.backward()
    grads = [v.value.grad for v in model.trainable_variables]
    if api == "keras3":
        optimizer.apply(grads, model.trainable_variables)
    else:
        grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    _check_loop_result(model, x, y)


def test_get_unscaled_gradients_keeps_dtypes():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2.0**20, max_scale=2.0**24
    )
    optimizer.get_scaled_loss(_tensor(1.0, "float32"))
    grads = optimizer.get_unscaled_gradients(
        [_tensor([1024.0], "float16"), _tensor([2.0**21], "float32"), None]
    )
    assert keras.backend.standardize_dtype(grads[0].dtype) == "float16"
    assert _numpy(grads[0])[0] == np.float16(2.0**-10)  # divided in float32
    assert _numpy(grads[1])[0] == 2.0
    assert grads[2] is None


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "torch", reason="counts PyTorch host reads")
def test_torch_apply_reads_one_flag_per_step(monkeypatch):
    """At most one host synchronisation per step, as torch.amp.GradScaler."""
    import torch

    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), dynamic_growth_steps=2)
    variables = [
        keras.Variable(np.ones((3, 3), np.float32)),
        keras.Variable(np.ones(3, np.float32)),
    ]
    optimizer.build(variables)
    reads = []
    for name in ("__bool__", "item", "tolist", "numpy", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for bad in (False, True, False, False):
        grads = [_tensor(np.full((3, 3), np.inf if bad else 1.0)), _tensor(np.ones(3))]
        reads.clear()
        optimizer.apply(grads, variables)
        assert len(reads) <= 1, reads
