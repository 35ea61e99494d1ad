"""PyTorch's loops of the chunked loss: what autograd keeps for the
backward pass holds no logits. The reduced loss keeps its gradients (the
hidden states', the weights', in float32, and the scalar they were
computed with); each token's loss keeps the hidden states, the labels, one
float32 log-sum-exp per token and the weights."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 24, 4, 50, 8


KEPT = {
    "sum_over_batch_size": [(TOKENS, HIDDEN), (), (HIDDEN, VOCABULARY)],
    "none": [(TOKENS, HIDDEN), (TOKENS,), (TOKENS,), (HIDDEN, VOCABULARY)],
}


@pytest.mark.parametrize("reduction", sorted(KEPT))
def test_the_backward_pass_keeps_no_logits(reduction):
    import torch

    head = lm_head.TokenHead(False, "bfloat16")
    rng = np.random.default_rng(0)
    hidden = torch.tensor(rng.normal(size=(TOKENS, HIDDEN)), dtype=torch.float32)
    kernel = torch.tensor(rng.normal(size=(HIDDEN, VOCABULARY)), dtype=torch.float32)
    hidden.requires_grad_(True)
    kernel.requires_grad_(True)
    labels = torch.tensor(rng.integers(0, VOCABULARY, TOKENS), dtype=torch.int32)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = lm_loss.sparse_cross_entropy(
            head, hidden, (kernel,), labels, reduction=reduction, chunk=CHUNK
        )
    assert sorted(saved) == sorted(KEPT[reduction])
    loss.sum().backward()
    assert kernel.grad.dtype == torch.float32 and kernel.grad.shape == kernel.shape
