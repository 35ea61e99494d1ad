"""PyTorch (`backends/torch.py`): one flag read per step, as GradScaler."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND
from tests.steps import tensor

pytestmark = SCALED_BY_HAND


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
        grads = [tensor(np.full((3, 3), np.inf if bad else 1.0)), tensor(np.ones(3))]
        reads.clear()
        optimizer.apply(grads, variables)
        assert len(reads) <= 1, reads
