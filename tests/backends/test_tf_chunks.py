"""TensorFlow's loops of the chunked loss (the reduced loss, its gradients
in the forward pass; each token's loss, computed again in the backward):
under `jit_compile` (XLA, whose loops need one shape an iteration: the
last chunk is padded) as without, the same loss and gradients."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 21, 4, 50, 8


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "none"])
def test_jit_compile_gives_the_same_loss_and_gradients(reduction):
    import tensorflow as tf

    head = lm_head.TokenHead(True, "float32", soft_cap=2.0)
    rng = np.random.default_rng(0)
    hidden = tf.constant(rng.normal(size=(TOKENS, HIDDEN)), tf.float32)
    table = tf.constant(rng.normal(size=(VOCABULARY, HIDDEN)), tf.float32)
    labels = tf.constant(rng.integers(0, VOCABULARY, TOKENS), tf.int32)

    def step(hidden, table):
        with tf.GradientTape() as tape:
            tape.watch([hidden, table])
            loss, _, _ = lm_loss.sparse_cross_entropy(
                head, hidden, (table,), labels, reduction=reduction, chunk=CHUNK
            )
            loss = tf.reduce_sum(loss)
        return [loss] + tape.gradient(loss, [hidden, table])

    eager = step(hidden, table)
    compiled = tf.function(step, jit_compile=True)(hidden, table)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
