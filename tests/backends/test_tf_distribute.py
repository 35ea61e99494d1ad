"""tf.distribute's refusals (`backends/tf_distribute.py`): a strategy or a
compilation the loss-scale step cannot run under is refused with the way
out, at `compile` and in a custom loop.

Each runs in a process of its own (`tests/distributed_worker.py`), whose two
logical CPUs must be configured before TensorFlow starts. That one replica's
NaN skips the step on every replica (`all_replicas_agree`,
`apply_across_replicas`) is proven by `tests/test_distributed.py`.
"""

import os

import keras
import pytest

from tests import processes

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed_worker.py")

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.distribute")


@pytest.mark.parametrize("scenario", ["tf_jit_refused", "tf_central_storage_refused"])
def test_a_step_that_cannot_decide_across_replicas_is_refused(scenario):
    assert f"{scenario}: ok" in processes.run_scenario(WORKER, scenario, "tensorflow")
