"""The chunked language-model loss: Keras's loss from the same logits,
gradients at least as close to float64 as the plain half step's, tied
embeddings, token counts and vocabularies that are not a multiple of the
chunk."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss
from tests.steps import BACKEND
from tests.steps import numpy

# 2 x 7 tokens in chunks of 4 (the last chunk short), a vocabulary of 37.
BATCH, LENGTH, HIDDEN, VOCABULARY, CHUNK = 2, 7, 8, 37, 4
IGNORED = 3

_rng = np.random.default_rng(0)
HIDDEN_STATES = _rng.normal(size=(BATCH, LENGTH, HIDDEN)).astype("float32")
LABELS = _rng.integers(0, VOCABULARY, size=(BATCH, LENGTH)).astype("int32")
LABELS[0, :2] = IGNORED
WEIGHTS = _rng.uniform(0.5, 2.0, size=(BATCH, LENGTH)).astype("float32")
WEIGHTS[1, -3:] = 0.0  # padding
KERNEL = (_rng.normal(size=(HIDDEN, VOCABULARY)) / np.sqrt(HIDDEN)).astype("float32")
BIAS = _rng.normal(size=(VOCABULARY,)).astype("float32")


def _dense(dtype):
    layer = keras.layers.Dense(VOCABULARY, dtype=dtype)
    layer.build((None, HIDDEN))
    layer.set_weights([KERNEL, BIAS])
    return layer


def _embedding(dtype, soft_cap=None):
    layer = keras.layers.ReversibleEmbedding(
        VOCABULARY, HIDDEN, tie_weights=True, logit_soft_cap=soft_cap, dtype=dtype
    )
    layer.build((None,))
    layer.set_weights([4.0 * KERNEL.T])
    return layer


@pytest.mark.parametrize(
    "dtype, make, reduction",
    [
        # Keras's Embedding family reads its table in its own dtype, its
        # inputs as given (no autocast): bfloat16 through and through.
        ("bfloat16", lambda d: _embedding(d, soft_cap=3.0), "sum_over_batch_size"),
        # The same loop in float32 (each backend's: the tied table's test);
        # the reductions are Keras's own code on each token's loss.
        pytest.param("float32", _dense, "sum_over_batch_size", marks=pytest.mark.one_backend),
        pytest.param("float32", _dense, "none", marks=pytest.mark.one_backend),
        pytest.param("mixed_bfloat16", _dense, "sum", marks=pytest.mark.one_backend),
        pytest.param("float32", _dense, "mean_with_sample_weight", marks=pytest.mark.one_backend),
    ],
    ids=[
        "bfloat16-tied-capped",
        "float32-dense",
        "float32-dense-none",
        "bfloat16-dense-sum",
        "float32-dense-mean-with-sample-weight",
    ],
)
def test_the_loss_is_keras_loss_of_the_same_logits(dtype, make, reduction):
    """Keras's loss (logits in the head's compute dtype, converted to
    float32), within 1e-5: ignore_class, padding weights, the reductions."""
    layer = make(dtype)
    hidden = ops.cast(HIDDEN_STATES, "bfloat16" if dtype == "bfloat16" else "float32")
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        logits = layer(hidden, reverse=True)
    else:
        logits = layer(hidden)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=IGNORED, reduction=reduction
    )
    expected = numpy(keras_loss(LABELS, logits, sample_weight=WEIGHTS))
    head, weights = lm_head.head_of(layer)
    loss, losses, correct = lm_loss.sparse_cross_entropy(
        head,
        hidden,
        weights,
        LABELS,
        sample_weight=WEIGHTS,
        ignore_class=IGNORED,
        reduction=reduction,
        chunk=CHUNK,
    )
    np.testing.assert_allclose(numpy(loss), expected, rtol=1e-5, atol=1e-7)
    assert numpy(losses).shape == LABELS.shape
    hits = np.argmax(numpy(ops.cast(logits, "float32")), -1) == LABELS
    np.testing.assert_array_equal(numpy(correct), hits.astype("float32"))


# -- gradients ------------------------------------------------------------------


def _value_and_grads(fn, *args):
    """`fn(*args)` and its gradients with respect to each argument."""
    args = [ops.convert_to_tensor(a) for a in args]
    if BACKEND == "jax":
        import jax

        return jax.value_and_grad(fn, argnums=tuple(range(len(args))))(*args)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(args)
            value = fn(*args)
        return value, tape.gradient(value, args)
    args = [a.detach().requires_grad_(True) for a in args]
    value = fn(*args)
    value.backward()
    return value, [a.grad for a in args]


def _plain(hidden, kernel, bias, labels=LABELS, dtype="bfloat16"):
    """The plain step's loss: Dense's matmul in `dtype`, Keras's loss on its
    float32 copy."""
    z = ops.matmul(ops.cast(hidden, dtype), ops.cast(kernel, dtype)) + ops.cast(bias, dtype)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras_loss(labels, ops.cast(z, "float32"), sample_weight=WEIGHTS)


def _chunked(hidden, kernel, bias, labels=LABELS, dtype="bfloat16"):
    head = lm_head.TokenHead(False, dtype, bias=True)
    return lm_loss.sparse_cross_entropy(
        head, hidden, (kernel, bias), labels, sample_weight=WEIGHTS, chunk=CHUNK
    )[0]


def _per_token(hidden, kernel, bias, labels=LABELS, dtype="bfloat16"):
    """The chunks' per-token losses (`reduction="none"`, their gradient
    computed again in the backward pass), reduced by Keras."""
    head = lm_head.TokenHead(False, dtype, bias=True)
    losses = lm_loss.sparse_cross_entropy(
        head, hidden, (kernel, bias), labels, reduction="none", chunk=CHUNK
    )[0]
    return ops.sum(ops.multiply(losses, WEIGHTS)) / LABELS.size


def _float64_grads():
    """The loss's gradients in float64 (numpy), from the same weights."""
    h, w = HIDDEN_STATES.astype("float64"), KERNEL.astype("float64")
    z = h @ w + BIAS.astype("float64")
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dz = (p - np.eye(VOCABULARY)[LABELS]) * (WEIGHTS / LABELS.size)[..., None]
    return dz @ w.T, np.einsum("btd,btv->dv", h, dz), dz.sum((0, 1))


@pytest.mark.parametrize(
    "dtype, chunked",
    [("bfloat16", _chunked), ("float16", _chunked), ("bfloat16", _per_token)],
    ids=["bfloat16", "float16", "bfloat16-per-token"],
)
def test_gradients_are_no_further_from_float64_than_the_plain_half_steps(dtype, chunked):
    """The hidden states' gradient as the plain step's (the same half
    matmul per row, rounded once), the kernel's closer (float32 across
    chunks, where the plain step rounds the whole sum to half); in float16
    too, where the plain step without loss scaling loses the small
    probabilities' gradients (the chunks keep them: `GRADIENT_SCALE`). The
    reduced loss computes its gradients in the forward pass, the
    per-token losses in the backward: the same values."""
    reference = _float64_grads()
    args = (HIDDEN_STATES, KERNEL, BIAS)
    _, plain = _value_and_grads(lambda h, k, b: _plain(h, k, b, dtype=dtype), *args)
    _, ours = _value_and_grads(lambda h, k, b: chunked(h, k, b, dtype=dtype), *args)

    def error(grad, ref):
        return np.linalg.norm(numpy(ops.cast(grad, "float32")) - ref) / np.linalg.norm(ref)

    for name, p, c, ref in zip(("hidden", "kernel"), plain, ours, reference):
        assert error(c, ref) <= 1.01 * error(p, ref), (name, error(c, ref), error(p, ref))
    # The bias's: the logits' rounding, both (its sum is float32's here).
    assert numpy(ours[2]).dtype == np.float32
    np.testing.assert_allclose(numpy(ours[2]), numpy(plain[2]), atol=1e-3)


def test_tied_embeddings_get_the_gradient_of_both_uses():
    """The table is read twice (the tokens' lookup, the head in reverse):
    its gradient is the sum, as the plain loss's (float32 everywhere)."""
    ids = LABELS[:, ::-1].copy()

    def loss(table, use):
        hidden = ops.take(table, ids, axis=0) * 2.0
        if use is _plain:
            z = ops.matmul(hidden, ops.transpose(table))
            keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            return keras_loss(LABELS, z, sample_weight=WEIGHTS)
        head = lm_head.TokenHead(True, "float32")
        return lm_loss.sparse_cross_entropy(
            head, hidden, (table,), LABELS, sample_weight=WEIGHTS, chunk=CHUNK
        )[0]

    table = KERNEL.T.copy()
    plain_loss, (plain,) = _value_and_grads(lambda t: loss(t, _plain), table)
    chunked_loss, (chunked,) = _value_and_grads(lambda t: loss(t, _chunked), table)
    np.testing.assert_allclose(numpy(chunked_loss), numpy(plain_loss), rtol=1e-5)
    np.testing.assert_allclose(numpy(chunked), numpy(plain), rtol=1e-4, atol=1e-6)


@pytest.mark.one_backend
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_reverse_dtype_is_the_chunks_matmul_dtype(tied):
    """`ReversibleEmbedding(reverse_dtype=...)` casts the hidden states and
    the table to it before the reverse matmul, tied or not: so do the chunks."""
    layer = keras.layers.ReversibleEmbedding(
        VOCABULARY, HIDDEN, tie_weights=tied, reverse_dtype="float32", dtype="mixed_bfloat16"
    )
    layer.build((None,))
    head, _ = lm_head.head_of(layer)
    assert head.compute_dtype == "float32"
