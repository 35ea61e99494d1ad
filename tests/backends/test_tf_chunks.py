"""TensorFlow's loop of the chunked loss: under `jit_compile` (XLA, whose
loops need one shape an iteration: the last chunk is padded) as without,
the same loss and gradients."""

import keras
import numpy as np
import pytest

from keras_mp._src.precision import lm_loss

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's loop")

TOKENS, HIDDEN, VOCABULARY, CHUNK = 21, 4, 50, 8


def test_jit_compile_gives_the_same_loss_and_gradients():
    import tensorflow as tf

    head = lm_loss.TokenHead(True, "float32", soft_cap=2.0)
    rng = np.random.default_rng(0)
    hidden = tf.constant(rng.normal(size=(TOKENS, HIDDEN)), tf.float32)
    table = tf.constant(rng.normal(size=(VOCABULARY, HIDDEN)), tf.float32)
    labels = tf.constant(rng.integers(0, VOCABULARY, TOKENS), tf.int32)

    def step(hidden, table):
        with tf.GradientTape() as tape:
            tape.watch([hidden, table])
            losses, _ = lm_loss.token_losses(head, hidden, (table,), labels, chunk=CHUNK)
            loss = tf.reduce_sum(losses)
        return [loss] + tape.gradient(loss, [hidden, table])

    eager = step(hidden, table)
    compiled = tf.function(step, jit_compile=True)(hidden, table)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
