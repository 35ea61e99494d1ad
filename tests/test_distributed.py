"""Loss scaling across replicas: tf.distribute and keras.distribution.

Devices have to be configured before the framework starts, so the scenarios
run in processes of their own (`tests/distributed_worker.py`); the scenarios
of one device set-up share one process, which pays the framework's import
and start-up once, and each still prints its own `ok` lines. Every scenario
injects a NaN that only one replica sees, and compares against a
single-device run on the same global batches (see the worker's docstring).
"""

import os

import keras
import pytest

from tests import processes

BACKEND = keras.backend.backend()
WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
# The names of the worker's `LEVELS`.
LEVELS = ("O0", "O2", "O3", "O3-compensated")


def _run_in_one_process(backend, scenarios, timeout):
    """Runs `scenarios` (name -> the cases it prints `ok` for) in one worker
    process; each must have printed `<name> <case>: ok`, or `<name>: ok`."""
    out = processes.run_scenario(WORKER, ",".join(scenarios), backend, timeout=timeout)
    for name, cases in scenarios.items():
        for case in cases:
            assert f"{name} {case}: ok" in out, out
        if not cases:
            assert f"{name}: ok" in out, out
    return out


# MirroredStrategy's `fit` at every level; a custom loop; a `.keras` round
# trip in the strategy's scope; two workers (their processes started first,
# running beside the others). The refusals (XLA, CentralStorageStrategy):
# tests/backends/test_tf_distribute.py.
TF_SCENARIOS = {
    "tf_fit": LEVELS,
    "tf_custom_loop": (),
    "tf_save_and_reload_in_scope": (),
    "tf_multi_worker": (),
}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
@pytest.mark.slow(reason="one TensorFlow process (and two for its workers) for four scenarios")
def test_tf_distribute():
    _run_in_one_process("tensorflow", TF_SCENARIOS, timeout=600)


# On four CPU devices: DataParallel at every level; ModelParallel with a
# LayoutMap, and with KerasHub Gemma's own; ZeRO-1 under both; a language
# model's loss chunk by chunk under DataParallel.
JAX_SCENARIOS = {
    "jax_data_parallel": LEVELS,
    # O1/O2 in bfloat16 differ from float16 by the dtype and the scale's
    # absence only, both checked by the other cells (CI's time).
    "jax_model_parallel": ("O2-float16", "O3-bfloat16", "O3-float16"),
    "jax_model_parallel_gemma": ("O3-bfloat16",),
    "jax_zero": (
        "DataParallel O2-float16",
        "ModelParallel O3-bfloat16",
        "ModelParallel O2-bfloat16-float8-moments",
        "without a distribution",
    ),  # fmt: skip
    "jax_chunked_loss": (),
}


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
@pytest.mark.slow(reason="one JAX process for four scenarios, each compiling its steps")
def test_jax_distribution():
    """`ModelParallel` + `LayoutMap` on a 2 x 2 mesh: master copies and
    slots laid out like their variables, the single-device run's steps, and
    an exact `.keras` round trip; `shard_optimizer_state=True` splits them
    over the batch axis, with the unsharded run's results."""
    _run_in_one_process("jax", JAX_SCENARIOS, timeout=600)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.distributed")
@pytest.mark.slow(reason="two JAX processes, each starting JAX and meeting at a coordinator")
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
