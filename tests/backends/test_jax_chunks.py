"""JAX's loop of the chunked loss: the program it lowers to holds one
chunk's logits, never all of them, forward and backward."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 24, 4, 50, 8


@pytest.mark.perf
def test_the_gradients_program_holds_one_chunks_logits():
    import jax

    from keras_mp._src.backends import hlo_text

    head = lm_loss.TokenHead(False, "bfloat16")
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(TOKENS, HIDDEN)).astype("float32")
    kernel = rng.normal(size=(HIDDEN, VOCABULARY)).astype("float32")
    labels = rng.integers(0, VOCABULARY, TOKENS).astype("int32")

    def loss(hidden, kernel, chunk):
        losses, _ = lm_loss.token_losses(head, hidden, (kernel,), labels, chunk=chunk)
        return losses.sum()

    def largest(chunk):
        grad = jax.jit(jax.grad(lambda h, k: loss(h, k, chunk), argnums=(0, 1)))
        return hlo_text.largest_array(grad.lower(hidden, kernel).as_text(dialect="hlo"))

    assert largest(TOKENS) >= TOKENS * VOCABULARY  # one chunk: the whole logits
    assert largest(CHUNK) == CHUNK * VOCABULARY
