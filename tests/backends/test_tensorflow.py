"""TensorFlow (`backends/tensorflow.py`): the XLA step keeps its skip a
conditional and reads the gradients once, the graph step passes them on
unscaled by 1 without a copy (compiled-graph checks, `perf`)."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src import backends
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND
from tests.steps import numpy
from tests.steps import snapshot
from tests.steps import tensor
from tests.steps import tensorflow_xla_on_cpu

pytestmark = SCALED_BY_HAND


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

    good = [tensor(np.ones((64, 32))), tensor(np.ones(32))]
    hlo = step.experimental_get_compiler_ir(good)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert " conditional(" in entry
    copies = [line for line in entry.splitlines() if " copy(" in line and "[] copy(" not in line]
    assert not [line for line in copies if "f32[64,32]" in line], copies

    step(good)
    before = snapshot(optimizer, variables)
    step([good[0], tensor(np.full(32, np.nan))])
    after = snapshot(optimizer, variables)
    state = {"loss_scale", "good_steps", "skipped_steps"}
    for variable, b, a in zip(variables + list(optimizer.variables), before, after):
        if variable.path.split("/")[-1] not in state:
            np.testing.assert_array_equal(a, b, err_msg=variable.path)
    assert int(numpy(optimizer.skipped_steps)) == 1


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graph step")
def test_a_unit_scale_passes_the_gradients_on_without_a_pass_over_them():
    """Issue 75.5: bfloat16's fixed scale of 1 has nothing to unscale. The
    graph step (`fit`'s on a CPU: no XLA) multiplies no gradient by 1, a
    pass that wrote each gradient out again (a ResNet50's 94 MB a step,
    where TensorFlow's O2 bfloat16 trained at 0.87x Keras's policy); it
    still skips a non-finite step."""
    import tensorflow as tf

    from keras_mp._src.backends import tf_graph

    def step_of(optimizer):
        variables = [keras.Variable(np.ones((16, 8), np.float32)) for _ in range(4)]
        optimizer.build(variables)

        @tf.function(jit_compile=False)
        def step(grads):
            optimizer.apply(grads, variables)

        graph = step.get_concrete_function([tf.TensorSpec((16, 8), tf.float32)] * 4).graph
        muls = sum(op.type == "Mul" for op in tf_graph.operations(graph))
        return step, variables, muls

    *_, bare = step_of(keras.optimizers.Adam(0.1))
    unit = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=1.0, dynamic=False)
    step, variables, muls = step_of(unit)
    assert muls == bare  # Adam's own: none for the unscaling
    good = [tensor(np.ones((16, 8)))] * 4
    step(good)
    before = snapshot(unit, variables)
    step(good[:3] + [tensor(np.full((16, 8), np.inf))])
    after = snapshot(unit, variables)
    for variable, b, a in zip(variables + list(unit.variables), before, after):
        if variable.path.split("/")[-1] not in ("good_steps", "skipped_steps"):
            np.testing.assert_array_equal(a, b, err_msg=variable.path)
    assert int(numpy(unit.skipped_steps)) == 1


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_check_of_float32_gradients_reads_them_once():
    """Under XLA the float32 check is a sum of each gradient; the elementwise
    `all(isfinite(g))` (an elementwise pass written out, then a separate
    reduction on XLA's CPU backend) runs only in the conditional's branch for a non-finite sum."""
    import tensorflow as tf

    check = tf.function(backends.current.all_finite, jit_compile=True)
    grads = [tensor(np.ones((64, 32))), tensor(np.ones(32))]
    hlo = check.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert " conditional(" in entry
    assert "pred[64,32]" not in entry, entry
    assert bool(numpy(check(grads)))
    assert not bool(numpy(check([grads[0], tensor([1.0] * 31 + [np.nan])])))
    assert bool(numpy(check([tensor(np.full((64, 32), 3e38)), grads[1]])))


@pytest.mark.perf
@tensorflow_xla_on_cpu
def test_xla_check_of_float16_gradients_reduces_rows_of_eight():
    """XLA's CPU backend reduces `isfinite` over rows of 8 values about twice
    as fast as over a layer's own shape; sizes that are not a multiple of 8 keep theirs."""
    import tensorflow as tf

    check = tf.function(backends.current.all_finite, jit_compile=True)
    grads = [tensor(np.ones((64, 32)), "float16"), tensor(np.ones(31), "float16")]
    hlo = check.experimental_get_compiler_ir(grads)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    assert "= pred[256,8]" in entry and "= pred[64,32]" not in entry, entry
    assert bool(numpy(check(grads)))
    for bad in (np.nan, np.inf, -np.inf):
        values = np.ones((64, 32))
        values[63, 31] = bad
        assert not bool(numpy(check([tensor(values, "float16"), grads[1]])))
        assert not bool(numpy(check([grads[0], tensor([1.0] * 30 + [bad], "float16")])))


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
    good = [tensor(rng.normal(size=(64, 32)), "float16"), tensor(rng.normal(size=32), "float16")]
    hlo = step.experimental_get_compiler_ir(good)(stage="optimized_hlo")
    entry = hlo[hlo.index("ENTRY") :]
    widened = [
        line
        for line in entry.splitlines()
        if "= f32[64,32]" in line and (" fusion(" in line or " convert(" in line)
    ]
    assert " conditional(" in entry
    assert not widened, widened

    for grads in (good, good, [good[0], tensor(np.full(32, np.nan), "float16")], good):
        step(grads)
        reference(grads)
        for a, b in zip(
            snapshot(optimizer, variables), snapshot(reference_optimizer, reference_variables)
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(numpy(optimizer.skipped_steps)) == 1
    assert int(numpy(optimizer.iterations)) == 3


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_narrow_origins_leaves_other_gradients_alone():
    grads = [tensor([1.0, 2.0]), None]
    assert backends.current.narrow_origins(grads) == grads
    assert backends.current.widen(grads, grads) == grads
