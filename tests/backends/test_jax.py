"""JAX (`backends/jax.py`): the skip as a `lax.cond` or as selects, each
compiled once."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src import backends
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND
from tests.steps import numpy
from tests.steps import tensor

pytestmark = SCALED_BY_HAND


def _jax_on_cpu():
    """JAX on a CPU: the CPU's finiteness check, and the CPU's copies."""
    if BACKEND != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


ON_CPU = _jax_on_cpu()


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's two forms of the skip")
def test_jax_skips_by_selects_on_every_platform(monkeypatch):
    """A `lax.cond` around the update holds a second copy of what it updates
    (issue 65): selects everywhere, `cond` when asked for."""
    import jax

    monkeypatch.delenv("KERAS_MP_JAX_SKIP_FORM", raising=False)
    for platform in ("cpu", "gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        assert backends.current.skips_by_select()
    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "cond")  # the documented switch
    assert not backends.current.skips_by_select()
    monkeypatch.setenv("KERAS_MP_JAX_SKIP_FORM", "sometimes")
    with pytest.raises(ValueError, match="KERAS_MP_JAX_SKIP_FORM='sometimes'"):
        backends.current.skips_by_select()


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's two forms of the skip")
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_jax_select_form_has_no_conditional(jax_skip_form, monkeypatch, platform):
    """A GPU waits for the device at each `cond`, and a CPU gives its results
    buffers of their own: the select form has none on either (a CPU's
    finiteness check included)."""
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    variables = [
        keras.Variable(np.ones((2, 2), np.float32)),
        keras.Variable(np.ones(2, np.float32)),
    ]
    optimizer.build(variables)
    grads = [tensor(np.ones((2, 2))), tensor(np.ones(2))]
    jaxpr = str(
        jax.make_jaxpr(optimizer.stateless_apply)(
            [v.value for v in optimizer.variables], grads, [v.value for v in variables]
        )
    )
    assert ("cond[" in jaxpr) == (jax_skip_form == "cond"), jaxpr


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's select form of the skip")
@pytest.mark.parametrize("master_weights", [False, True])
def test_jax_select_form_copies_no_slot(monkeypatch, master_weights):
    """The select form updates the slots in place, as the plain step does.

    With master weights, the half weight is cast from the kept copy as
    written (`backends.computed_once`): fused again from the old copy, XLA's
    CPU compiler copied each master copy and half weight first.

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
    grads = [tensor(np.ones((64, 32)), dtype), tensor(np.ones(32))]

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
    good = tensor(np.array([3.0, -2.0, 0.5]))
    bad = tensor(np.array([np.inf, 1.0, 1.0]))
    for grad in [good, bad, good, bad, bad, good]:
        optimizer.apply([grad], [variable])
        with jax.disable_jit():  # every op on its own, `cond` as a Python `if`
            reference.apply([grad], [reference_variable])
    assert len(traced) == 1
    np.testing.assert_allclose(numpy(variable), numpy(reference_variable), rtol=1e-6)
    for slot, reference_slot in zip(optimizer.variables, reference.variables):
        np.testing.assert_allclose(numpy(slot), numpy(reference_slot), rtol=1e-6, err_msg=slot.path)
    assert int(numpy(optimizer.skipped_steps)) == 3
    assert int(numpy(optimizer.iterations)) == 3
    assert float(numpy(optimizer.loss_scale)) == 2.0


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's rounding of compensated updates")
def test_bfloat16_rounding_is_a_reduce_precision_xla_keeps():
    """Compensated updates keep `x - rounded(x)`. As a pair of converts, XLA's
    GPU compiler drops the rounding under excess precision and keeps 0 (an
    H100, 2026-11-27: the compensated tests failed there); a reduce-precision
    it keeps."""
    import jax

    text = (
        jax.jit(lambda x: x - backends.current.rounded(x, "bfloat16"))
        .lower(np.ones(4, "float32"))
        .as_text()
    )
    assert "reduce_precision" in text and "convert" not in text


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's finiteness check")
def test_jax_checks_the_gradients_of_a_dtype_at_once():
    """One finiteness check for each dtype's gradients, flattened end to end:
    XLA's CPU runs each check as kernels of its own, a check per gradient
    was 3 kernels each (a small model's step spent more in them than in
    its update). A non-finite value in any of them still skips the step."""
    import jax

    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    shapes = [(3, 4), (4,), (4, 2)]
    variables = [keras.Variable(np.ones(s, np.float32)) for s in shapes]
    optimizer.build(variables)
    grads = [tensor(np.ones(s)) for s in shapes]
    values = [v.value for v in optimizer.variables], [v.value for v in variables]
    jaxpr = str(jax.make_jaxpr(optimizer.stateless_apply)(values[0], grads, values[1]))
    assert jaxpr.count("is_finite") == 1, jaxpr
    grads[1] = tensor(np.array([1.0, np.inf, 1.0, 1.0]))
    new_variables, _ = jax.jit(optimizer.stateless_apply)(values[0], grads, values[1])
    assert all(np.array_equal(numpy(n), numpy(v)) for n, v in zip(new_variables, values[1]))
