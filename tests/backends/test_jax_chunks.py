"""JAX's loops of the chunked loss: the program they lower to holds one
chunk's logits, never all of them, forward and backward; the reduced
loss (its gradients in the forward pass) as each token's loss (computed
again in the backward pass)."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 24, 4, 50, 8


@pytest.mark.perf
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "none"])
def test_the_gradients_program_holds_one_chunks_logits(reduction):
    import jax

    from keras_mp._src.backends import hlo_text

    head = lm_head.TokenHead(False, "bfloat16")
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(TOKENS, HIDDEN)).astype("float32")
    kernel = rng.normal(size=(HIDDEN, VOCABULARY)).astype("float32")
    labels = rng.integers(0, VOCABULARY, TOKENS).astype("int32")

    def loss(hidden, kernel, chunk):
        loss, _, _ = lm_loss.sparse_cross_entropy(
            head, hidden, (kernel,), labels, reduction=reduction, chunk=chunk
        )
        return loss.sum()

    def largest(chunk):
        grad = jax.jit(jax.grad(lambda h, k: loss(h, k, chunk), argnums=(0, 1)))
        return hlo_text.largest_array(grad.lower(hidden, kernel).as_text(dialect="hlo"))

    assert largest(TOKENS) >= TOKENS * VOCABULARY  # one chunk: the whole logits
    assert largest(CHUNK) == CHUNK * VOCABULARY
