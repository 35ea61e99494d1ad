"""LossScaleOptimizer: construction, skipping, unscaling, interplay with the
inner optimizer's features, serialization, custom training loops."""

import warnings

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_mp
from tests.loops import check_loop_result
from tests.loops import loop_data
from tests.loops import loop_model
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND
from tests.steps import numpy
from tests.steps import snapshot
from tests.steps import tensor

pytestmark = SCALED_BY_HAND


# -- the public surface ---------------------------------------------------------


def test_public_names():
    assert set(keras_mp.__all__) == {
        "ALLOW_LIST",
        "DENY_LIST",
        "Float8Recipe",
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
        "speed_report",
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


def test_learning_rate_is_the_inner_one():
    inner = keras.optimizers.SGD(0.25)
    optimizer = keras_mp.LossScaleOptimizer(inner)
    assert float(numpy(optimizer.learning_rate)) == 0.25
    optimizer.learning_rate = 0.5
    assert float(numpy(inner.learning_rate)) == 0.5


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
        ({"min_scale": 1e-40}, ValueError, "at least 2**-126"),  # a subnormal float32
        ({"min_scale": float("nan")}, ValueError, "or None for no floor. Received: min_scale=nan"),
        ({"min_scale": "1"}, ValueError, "min_scale='1'"),
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
    if value is None:  # tf.keras 2's "the default"; no floor for `min_scale`
        defaults = {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000, "min_scale": None}
        assert config[argument] == defaults[argument]
        return
    assert config[argument] == value
    assert (optimizer.min_scale or 0) <= optimizer.initial_scale <= optimizer.max_scale
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
    good = [tensor([1.0, -2.0, 3.0, 4.0]), tensor([[1.0, 2.0], [3.0, 4.0]])]
    optimizer.apply(good, variables)  # non-zero slots
    before = snapshot(optimizer, variables)
    iterations = int(numpy(optimizer.iterations))
    optimizer.apply([good[0], tensor([[1.0, bad], [3.0, 4.0]])], variables)
    after = snapshot(optimizer, variables)
    state_paths = {"loss_scale", "good_steps", "skipped_steps"}
    names = [v.path.split("/")[-1] for v in variables] + [
        v.path.split("/")[-1] for v in optimizer.variables
    ]
    for name, b, a in zip(names, before, after):
        if name not in state_paths:
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert int(numpy(optimizer.iterations)) == iterations
    assert int(numpy(optimizer.skipped_steps)) == 1
    assert float(numpy(optimizer.loss_scale)) == 2.0


def test_fixed_scale_without_skipping_applies_every_step():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=2.0, skip_on_overflow=False
    )
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer.apply([tensor([np.inf, 2.0])], [variable])
    np.testing.assert_array_equal(numpy(variable), [-np.inf, -1.0])
    assert int(numpy(optimizer.iterations)) == 1
    assert int(numpy(optimizer.skipped_steps)) == 0
    assert float(numpy(optimizer.loss_scale)) == 2.0


def test_fixed_scale_skips_but_keeps_the_scale():
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=1024.0
    )
    variable = keras.Variable(np.zeros(2, np.float32))
    for _ in range(3):
        optimizer.apply([tensor([np.nan, 2.0])], [variable])
    optimizer.apply([tensor([1024.0, 2048.0])], [variable])
    np.testing.assert_array_equal(numpy(variable), [-1.0, -2.0])
    assert float(numpy(optimizer.loss_scale)) == 1024.0
    assert int(numpy(optimizer.skipped_steps)) == 3


# -- the finiteness check --------------------------------------------------------


# -- unscaling -------------------------------------------------------------------


def test_unscaled_gradient_reaches_clipping():
    """clipnorm on the inner optimizer sees the unscaled gradient."""
    inner = keras.optimizers.SGD(1.0, clipnorm=1.0)
    optimizer = keras_mp.LossScaleOptimizer(inner, initial_scale=2.0**10)
    variable = keras.Variable(np.zeros(2, np.float32))
    # Unscaled: [0.3, 0.4], norm 0.5 < 1: no clipping. Scaled: norm 512.
    optimizer.apply([tensor([0.3 * 1024, 0.4 * 1024])], [variable])
    np.testing.assert_allclose(numpy(variable), [-0.3, -0.4], rtol=1e-6)
    # Unscaled [3, 4], norm 5: clipped to norm 1.
    optimizer.apply([tensor([3.0 * 1024, 4.0 * 1024])], [variable])
    np.testing.assert_allclose(numpy(variable), [-0.9, -1.2], rtol=1e-6)


@pytest.mark.parametrize(
    "clip, expected",
    [({"global_clipnorm": 1.0}, [-0.6, -0.8]), ({"clipvalue": 2.0}, [-2.0, -0.5])],
)
def test_other_clipping_sees_unscaled_gradients(clip, expected):
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(1.0, **clip), initial_scale=256.0)
    variable = keras.Variable(np.zeros(2, np.float32))
    grad = [3.0, 0.5] if "clipvalue" in clip else [3.0, 4.0]
    optimizer.apply([tensor(np.array(grad) * 256.0)], [variable])
    np.testing.assert_allclose(numpy(variable), expected, rtol=1e-6)


def test_gradient_accumulation_drops_only_the_bad_micro_batch(jax_skip_form):
    inner = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    optimizer = keras_mp.LossScaleOptimizer(inner, initial_scale=4.0, dynamic_growth_steps=100)
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer.build([variable])
    optimizer.apply([tensor([4.0, 8.0])], [variable])  # accumulated: [1, 2]
    np.testing.assert_array_equal(numpy(variable), [0.0, 0.0])
    optimizer.apply([tensor([np.nan, 8.0])], [variable])  # dropped
    np.testing.assert_array_equal(numpy(variable), [0.0, 0.0])
    # The scale is now 2; this micro-batch is [3, 4] unscaled.
    optimizer.apply([tensor([6.0, 8.0])], [variable])
    np.testing.assert_array_equal(numpy(variable), [-2.0, -3.0])  # mean of [1,2],[3,4]
    assert int(numpy(optimizer.iterations)) == 1
    assert int(numpy(optimizer.skipped_steps)) == 1


# -- serialization -------------------------------------------------------------


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
        assert numpy(getattr(loaded.optimizer, name)) == numpy(getattr(optimizer, name)), name
    assert float(numpy(loaded.optimizer.loss_scale)) == 32.0
    assert int(numpy(loaded.optimizer.skipped_steps)) == 1


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_building_a_built_optimizer_again_changes_nothing(tmp_path, level):
    """As Keras's optimizers: `build` on a built optimizer (a loaded model's,
    built by its load) keeps its variables; at O3 its master copies were
    made again, unknown to the inner optimizer, and the next `fit` failed."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse", amp_level=level
    )
    x, y = np.linspace(-1, 1, 32, dtype="float32").reshape(8, 4), np.ones((8, 1), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    rebuilt, loaded = keras.models.load_model(path), keras.models.load_model(path)
    before = list(rebuilt.optimizer.variables)
    rebuilt.optimizer.build(rebuilt.trainable_variables)
    assert [id(v) for v in rebuilt.optimizer.variables] == [id(v) for v in before]
    for m in (rebuilt, loaded):
        m.fit(x, y, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(
        snapshot(rebuilt.optimizer, rebuilt.weights), snapshot(loaded.optimizer, loaded.weights)
    ):
        np.testing.assert_array_equal(a, b)


# -- custom training loops -----------------------------------------------------


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.GradientTape loop")
@pytest.mark.parametrize("api", ["keras3", "tf_keras2"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_custom_loop_tensorflow(api, graph):
    import tensorflow as tf

    x, y = loop_data()
    model = loop_model()
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
    check_loop_result(model, x, y)
    assert int(numpy(optimizer.iterations)) == 1


@pytest.mark.skipif(BACKEND != "jax", reason="eager apply on JAX")
def test_custom_loop_jax_apply():
    import jax

    x, y = loop_data()
    model = loop_model()
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)

    def loss_fn(trainable):
        pred, _ = model.stateless_call(trainable, [], x)
        return optimizer.scale_loss(jax.numpy.mean(jax.numpy.square(pred - y)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager: the variable's scale is the step's
        grads = jax.grad(loss_fn)([v.value for v in model.trainable_variables])
        optimizer.apply(grads, model.trainable_variables)
    check_loop_result(model, x, y)


@pytest.mark.skipif(BACKEND != "torch", reason="loss.backward() loop")
@pytest.mark.parametrize("api", ["keras3", "tf_keras2"])
def test_custom_loop_torch(api):
    import torch

    x, y = loop_data()
    model = loop_model()
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
    check_loop_result(model, x, y)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="AutoGraph is TensorFlow's")
def test_autograph_converts_apply_in_a_users_tf_function():
    """A TensorFlow custom loop's `tf.function` converts `apply` with
    AutoGraph: a construct it cannot transform (`:=`) made it fall back and
    log "could not transform ... Please report this to the TensorFlow team"
    on every user's first step."""
    import tensorflow as tf

    tf.autograph.to_graph(keras_mp.LossScaleOptimizer.apply)
    tf.autograph.to_graph(keras_mp.LossScaleOptimizer.scale_loss)
