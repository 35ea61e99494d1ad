"""Loss scaling across replicas: tf.distribute and keras.distribution.

Each scenario runs in its own process (`tests/distributed_worker.py`): the
devices have to be configured before the framework starts. Every scenario
injects a NaN that only one replica sees, and compares against a
single-device run on the same global batches (see the worker's docstring).
"""

import os

import keras
import pytest

from tests import processes

BACKEND = keras.backend.backend()
WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
# The names of the worker's `LEVELS` (it configures devices at import).
LEVELS = ("O0", "O2", "O3", "O3-compensated")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
@pytest.mark.parametrize(
    "scenario",
    [
        "tf_fit",
        "tf_custom_loop",
        "tf_save_and_reload_in_scope",
        "tf_multi_worker",
    ],
)
def test_tf_distribute(scenario):
    out = processes.run_cases(
        WORKER, scenario, "tensorflow", LEVELS if scenario == "tf_fit" else ()
    )
    assert f"{scenario}" in out


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_jax_data_parallel():
    processes.run_cases(WORKER, "jax_data_parallel", "jax", LEVELS)


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_jax_model_parallel_at_every_level():
    """`ModelParallel` + `LayoutMap` on a 2 x 2 mesh, O1 and O2 in float16,
    O3 in bfloat16 and float16: master copies and slots laid out like their
    variables, the single-device run's steps, and an exact `.keras` round
    trip. (O1/O2 in bfloat16 differ from float16 by the dtype and the
    scale's absence only, both checked by every other cell; CI's time.)"""
    cases = ["O1-float16", "O2-float16", "O3-bfloat16", "O3-float16"]
    processes.run_cases(WORKER, "jax_model_parallel", "jax", cases)


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_jax_model_parallel_with_keras_hub_s_layout_map():
    processes.run_cases(WORKER, "jax_model_parallel_gemma", "jax", ("O2-float16", "O3-bfloat16"))


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_jax_zero_shards_the_optimizer_state_over_the_replicas():
    cases = [f"{where} {level}" for where in ("DataParallel", "ModelParallel")
             for level in ("O2-float16", "O3-bfloat16", "O2-bfloat16-float8-moments")]  # fmt: skip
    out = processes.run_cases(WORKER, "jax_zero", "jax", cases)
    assert "jax_zero without a distribution: refused" in out, out


@pytest.mark.skipif(BACKEND != "jax", reason="jax.distributed")
def test_two_jax_processes_make_one_skip_decision_and_keep_one_set_of_weights():
    """Two processes on this machine (`jax.distributed.initialize`, CPU
    collectives over gloo), one device each, under `DataParallel`; only
    process 0 sees the NaN. Each checks itself against one device trained on
    the global batches; here, both must report the same state and weights."""
    first, second = processes.run_side_by_side(WORKER, "jax_two_processes", "jax")
    assert [r["level"] for r in first] == ["O2", "O3"]
    for a, b in zip(first, second):
        assert (a["process"], b["process"]) == (0, 1)
        assert {**a, "process": None} == {**b, "process": None}, (a, b)
        assert a["skipped_steps"] == 2  # the NaN batch, once an epoch, on both
