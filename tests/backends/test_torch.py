"""PyTorch (`backends/torch.py`): one flag read per step, as GradScaler."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mp
from keras_mp._src import backends

BACKEND = keras.backend.backend()

# These tests hand the optimizer gradients they scaled themselves, which
# the optimizer's warning of a loss never scaled tells to ignore.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:LossScaleOptimizer\.\w+ was called, but the loss was never scaled"
)

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
