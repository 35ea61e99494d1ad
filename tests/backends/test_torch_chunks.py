"""PyTorch's loop of the chunked loss: what autograd keeps for the backward
pass is the hidden states, the labels, one float32 log-sum-exp per token
and the weights; no logits."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 24, 4, 50, 8


def test_the_backward_pass_keeps_no_logits():
    import torch

    head = lm_loss.TokenHead(False, "bfloat16")
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
        losses, _ = lm_loss.token_losses(head, hidden, (kernel,), labels, chunk=CHUNK)
    assert sorted(saved) == sorted([(TOKENS, HIDDEN), (TOKENS,), (TOKENS,), (HIDDEN, VOCABULARY)])
    losses.sum().backward()
    assert kernel.grad.dtype == torch.float32 and kernel.grad.shape == kernel.shape
