"""A language model's sparse cross-entropy without its logits: chunk by chunk.

A language model's head (a `Dense`, or a `ReversibleEmbedding` called with
`reverse=True`, tied or not, with Gemma 2's logit soft-cap) makes logits of
batch x tokens x vocabulary; Keras's loss converts them to float32 and keeps
both, and their gradient, for the backward pass: at a 256k vocabulary the
step's largest tensors by far. Here the tokens are cut into chunks; each
chunk's logits come from the head's matmul in its compute dtype, as the
head computes them, and are reduced at once with a float32 log-sum-exp.

Keras's reduction is linear in the tokens' losses (`shares`), so a reduced
loss's gradients are known in the forward pass up to the one scalar the
backward pass brings (Liger Kernel's fused linear cross-entropy): each
chunk's gradients are computed with its loss (three matmuls a chunk, as
the plain step's), the head's weight gradients added across chunks in
float32 (a half accumulation drifts: Liger-Kernel #512), and the backward
pass multiplies them by its scalar. What is kept for it is those
gradients. Each token's loss (`reduction="none"`) has a gradient per
token: there the backward pass computes each chunk's logits again (Apple's
Cut Cross-Entropy, MaxText's vocabulary tiling) from what the forward pass
kept, the hidden states, the labels and one log-sum-exp per token.

The arithmetic of a chunk is written once here, in `keras.ops`; the loop
over chunks and its custom gradient are each backend's
(`backends.current.chunked_loss` and `chunked_token_losses`:
`jax.custom_vjp` over `lax.scan` and `lax.map`, `torch.autograd.Function`s,
`tf.custom_gradient` over `tf.while_loop`s). The reduction is Keras's own
(its helpers, `reduce_weighted_values`'s steps): `ignore_class`, a padding
mask, `sample_weight` and every `reduction` as
`keras.losses.SparseCategoricalCrossentropy` computes them.
"""

import dataclasses
import functools

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.backends import cpu_rates
from keras_mp._src.precision.lm_head import TokenHead

# Logits a chunk may hold (float32 elements): 128 MiB a chunk, whatever the
# vocabulary: a GEMM wide enough to run at the machine's rate, and few
# chunks (each adds passes over the weights' float32 gradient). The loss
# and its gradients alone, a 256k vocabulary, 512 tokens, JAX on a 2-core
# CPU: 64 tokens a chunk 15.3 s against the plain loss's 8.9, 128 tokens
# 11.4 s against 9.4.
CHUNK_LOGITS = 2**25


def chunk_tokens(vocabulary, budget=CHUNK_LOGITS):
    """Tokens a chunk takes: a multiple of 8 whose logits fit `budget`."""
    return max(8, budget // max(1, vocabulary) // 8 * 8)


# -- one chunk --------------------------------------------------------------------


@functools.cache
def gemm_dtype(compute):
    """The dtype the head's GEMMs take their operands in: the compute dtype
    where the device multiplies it natively (a GPU; a CPU with AVX512-BF16
    or AMX), else float32: a CPU without converts a half GEMM's operands to
    float32 at each call, the whole table once per chunk; here it is
    converted once, the values the same (half values, exact products,
    float32 sums, the result rounded to half)."""
    if compute not in ("float16", "bfloat16") or backends.current.gpu_compute_capability():
        return compute
    return compute if cpu_rates.native(cpu_rates.cpu_flags(), compute) else "float32"


def prepare(head, weights):
    """The weights as the head's matmul reads them (cast once, not per
    chunk): the kernel's half values in `gemm_dtype`, the bias in half."""
    gemm = gemm_dtype(head.compute_dtype)
    kernel = ops.cast(ops.cast(weights[0], head.compute_dtype), gemm)
    return (kernel,) + tuple(ops.cast(w, head.compute_dtype) for w in weights[1:])


def _gemm(head, equation, a, b, rounded):
    """A half GEMM of the head's (`a` in half, `b` prepared), its result
    rounded to half."""
    z = ops.einsum(equation, ops.cast(a, gemm_dtype(head.compute_dtype)), b)
    return rounded(ops.cast(z, head.compute_dtype))


def _hidden(head, hidden):
    """The hidden states as the head's matmul reads them."""
    if head.input_dtype:
        hidden = ops.cast(hidden, head.input_dtype)
    return ops.cast(hidden, head.compute_dtype)


def _raw_logits(head, hidden, ready, rounded):
    h = _hidden(head, hidden)
    z = _gemm(head, "cd,vd->cv" if head.transposed else "cd,dv->cv", h, ready[0], rounded)
    return rounded(z + ready[1]) if head.bias else z


def _capped(head, z, rounded):
    """The soft-cap as the layer computes it, each op rounded to its
    compute dtype (`rounded`: where a compiler would keep float32 between
    them, the backend's rounding; else nothing)."""
    if head.soft_cap is None:
        return z
    z = rounded(ops.tanh(rounded(ops.divide(z, head.soft_cap))))
    return rounded(ops.multiply(z, head.soft_cap))


def _valid(labels, vocabulary, ignore_class):
    valid = ops.logical_and(ops.greater_equal(labels, 0), ops.less(labels, vocabulary))
    if ignore_class is None:
        return valid
    return ops.logical_and(valid, ops.not_equal(labels, ignore_class))


def _logits(head, hidden, ready, rounded):
    """`(raw, z)`: a chunk's logits as the head's matmul gives them, and
    in float32 after the soft-cap."""
    raw = _raw_logits(head, hidden, ready, rounded)
    return raw, ops.cast(_capped(head, raw, rounded), "float32")


def _losses(z, labels, ignore_class):
    """`(losses, lse, correct)` of a chunk's float32 logits `z`."""
    vocabulary = ops.shape(z)[-1]
    valid = _valid(labels, vocabulary, ignore_class)
    safe = ops.where(valid, labels, 0)
    lse = ops.logsumexp(z, axis=-1)
    target = ops.squeeze(ops.take_along_axis(z, ops.expand_dims(safe, -1), axis=-1), -1)
    losses = ops.where(valid, lse - target, 0.0)
    correct = ops.cast(ops.equal(ops.argmax(z, axis=-1), ops.cast(labels, "int32")), "float32")
    return losses, lse, correct


def chunk_forward(head, hidden, labels, ready, rounded, ignore_class=None):
    """`(losses, lse, correct)` of one chunk: each token's float32 loss (0
    for `ignore_class`, or a label outside the vocabulary), its
    log-sum-exp, and whether the logits' argmax is its label."""
    _, z = _logits(head, hidden, ready, rounded)
    return _losses(z, labels, ignore_class)


def _dz(head, raw, z, lse, labels, g, ignore_class):
    """The logits' float32 gradient of a chunk: the softmax minus the
    label, times each token's `g`, through the soft-cap's derivative."""
    vocabulary = ops.shape(z)[-1]
    valid = _valid(labels, vocabulary, ignore_class)
    safe = ops.where(valid, labels, 0)
    g = ops.expand_dims(ops.where(valid, ops.cast(g, "float32"), 0.0), -1)
    dz = (
        ops.exp(z - ops.expand_dims(lse, -1)) - ops.one_hot(safe, vocabulary, dtype="float32")
    ) * g
    if head.soft_cap is not None:
        t = ops.tanh(ops.cast(raw, "float32") / head.soft_cap)
        dz = dz * (1.0 - t * t)
    return dz


def _through_head(head, hidden, dz, ready, matmul32):
    """`(d hidden, d weights)` from the logits' gradient, all float32: the
    two matmuls take `dz` in the compute dtype (a float32 GEMM there runs
    many times slower: Levanter's note) and give float32 results
    (`matmul32(eq, a, b)`, the backend's), so the weights' gradients add
    up across chunks in float32 and the hidden states' round once."""
    dz_half = ops.cast(dz, head.compute_dtype)
    gemm = gemm_dtype(head.compute_dtype)
    h = ops.cast(_hidden(head, hidden), gemm)
    dz_gemm = ops.cast(dz_half, gemm)
    if head.transposed:
        dh = matmul32("cv,vd->cd", dz_gemm, ready[0])
        dkernel = matmul32("cv,cd->vd", dz_gemm, h)
    else:
        dh = matmul32("cv,dv->cd", dz_gemm, ready[0])
        dkernel = matmul32("cd,cv->dv", h, dz_gemm)
    return dh, ((dkernel, ops.sum(dz, axis=0)) if head.bias else (dkernel,))


def chunk_backward(
    head, hidden, labels, lse, upstream, ready, matmul32, rounded, ignore_class=None
):
    """`(d hidden, d weights)` of one chunk, its logits computed again
    (`rounded`: as in `chunk_forward`, the same logits), for a gradient
    that comes per token (`reduction="none"`)."""
    raw, z = _logits(head, hidden, ready, rounded)
    dz = _dz(head, raw, z, lse, labels, upstream, ignore_class)
    dh, grads = _through_head(head, hidden, dz, ready, matmul32)
    return ops.cast(dh, hidden.dtype), grads


def chunk_with_gradients(
    head, hidden, labels, share, prescale, ready, matmul32, rounded, ignore_class=None
):
    """One chunk's loss and gradients at once (Liger Kernel's form: the
    loss is a sum of the tokens' losses, each with its `share`, so its
    gradients are known before the backward pass up to one scalar):
    `(loss, losses, correct, d hidden, d weights)`, the loss `sum(share *
    losses)`, the gradients those of `prescale` times it (float32; d hidden
    in float32 too). `prescale` brings the largest share to
    `GRADIENT_SCALE[dtype]`: the logits' gradient in float16 keeps a
    small probability's bits, as loss scaling keeps the plain step's."""
    raw, z = _logits(head, hidden, ready, rounded)
    losses, lse, correct = _losses(z, labels, ignore_class)
    dz = _dz(head, raw, z, lse, labels, share * prescale, ignore_class)
    dh, grads = _through_head(head, hidden, dz, ready, matmul32)
    return ops.sum(losses * share), losses, correct, dh, grads


# -- the loss -------------------------------------------------------------------


def token_losses(head, hidden, weights, labels, chunk=None, ignore_class=None):
    """`(losses, correct)`, each of `labels`' shape: each token's float32
    cross-entropy from `hidden` (`labels`' shape plus the hidden size)
    through the head, chunk by chunk (`chunk` tokens; None: `chunk_tokens`),
    0 where the label is `ignore_class`; and whether its logits' argmax is
    its label (no gradient)."""
    weights = tuple(ops.convert_to_tensor(w) for w in weights)
    vocabulary = head.vocabulary(weights[0])
    chunk = chunk or chunk_tokens(vocabulary)
    labels = _int_labels(labels)
    shape = ops.shape(labels)
    flat_hidden = ops.reshape(hidden, (-1, ops.shape(hidden)[-1]))
    flat_labels = ops.reshape(labels, (-1,))
    losses, correct = backends.current.chunked_token_losses(
        _Chunks(head, ignore_class), flat_hidden, flat_labels, weights, chunk
    )
    return ops.reshape(losses, shape), ops.reshape(correct, shape)


def _int_labels(labels):
    labels = ops.convert_to_tensor(labels)
    return labels if keras.backend.is_int_dtype(labels.dtype) else ops.cast(labels, "int32")


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """One chunk's arithmetic, as a backend's loop calls it."""

    head: TokenHead
    ignore_class: object = None

    def prepare(self, weights):
        return prepare(self.head, weights)

    def forward(self, hidden, labels, ready, rounded):
        return chunk_forward(self.head, hidden, labels, ready, rounded, self.ignore_class)

    def backward(self, hidden, labels, lse, upstream, ready, matmul32, rounded):
        return chunk_backward(
            self.head, hidden, labels, lse, upstream, ready, matmul32, rounded, self.ignore_class
        )

    def with_gradients(self, hidden, labels, share, prescale, ready, matmul32, rounded):
        return chunk_with_gradients(
            self.head, hidden, labels, share, prescale, ready, matmul32, rounded, self.ignore_class
        )


# The largest share of the loss a token's logits' gradient is computed
# with, before the backward pass's scalar (`chunk_with_gradients`): float16's
# gradient of a probability of 1e-8 stays a normal number, and no element
# exceeds float16's range (|softmax - label| <= 1).
GRADIENT_SCALE = {"float16": 2.0**14}


def shares(shape, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype="float32"):
    """Each token's share of Keras's reduced loss, `d loss / d its loss`:
    `reduce_weighted_values` is linear in the tokens' losses (its weights,
    mask and divisor do not depend on them). The same steps, in Keras's own
    helpers: the mask merged into the weights, the weights brought to the
    losses' rank, the divisor of the reduction, the distribution's scale."""
    reduction = keras_internals.standardize_reduction(reduction)
    ones = ops.ones(shape, dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    weight = keras_internals.apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)
    share = ones
    if weight is not None:
        weight = ops.cast(weight, dtype)
        ones, weight = keras_internals.squeeze_or_expand_to_same_rank(ones, weight)
        share = ops.reshape(ones * weight, shape)
    if reduction == "sum":
        return share
    if reduction == "mean_with_sample_weight" and weight is not None:
        divisor = ops.sum(weight)
    else:
        divisor = ops.cast(ops.prod(ops.convert_to_tensor(shape, dtype="int32")), dtype)
    return keras_internals.scale_loss_for_distribution(ops.divide_no_nan(share, divisor))


def sparse_cross_entropy(
    head,
    hidden,
    weights,
    labels,
    sample_weight=None,
    mask=None,
    ignore_class=None,
    reduction="sum_over_batch_size",
    chunk=None,
    dtype="float32",
):
    """`keras.losses.SparseCategoricalCrossentropy(from_logits=True,
    ignore_class=..., reduction=...)` of the logits the head would make from
    `hidden`, never holding them: `(loss, losses, correct)`, the loss
    reduced as Keras reduces it (`mask`: the logits' Keras mask, as Keras's
    loss reads it from `y_pred`), each token's loss, and each token's
    argmax hit (for an accuracy metric)."""
    if keras_internals.standardize_reduction(reduction) in (None, "none"):
        losses, correct = token_losses(head, hidden, weights, labels, chunk, ignore_class)
        if ignore_class is not None:
            valid = ops.not_equal(ops.convert_to_tensor(labels), ignore_class)
            mask = valid if mask is None else ops.logical_and(mask, valid)
        loss = keras_internals.reduce_weighted_values(
            losses, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype
        )
        return loss, losses, correct
    labels = _int_labels(labels)
    if ignore_class is not None:
        valid = ops.not_equal(labels, ignore_class)
        mask = valid if mask is None else ops.logical_and(mask, valid)
    shape = ops.shape(labels)
    share = shares(shape, sample_weight, mask, reduction)
    weights = tuple(ops.convert_to_tensor(w) for w in weights)
    chunk = chunk or chunk_tokens(head.vocabulary(weights[0]))
    scale = GRADIENT_SCALE.get(head.compute_dtype, 1.0)
    largest = ops.max(ops.abs(share))
    prescale = ops.where(largest > 0, scale / ops.where(largest > 0, largest, 1.0), 0.0)
    loss, losses, correct = backends.current.chunked_loss(
        _Chunks(head, ignore_class),
        ops.reshape(hidden, (-1, ops.shape(hidden)[-1])),
        ops.reshape(labels, (-1,)),
        ops.reshape(share, (-1,)),
        prescale,
        weights,
        chunk,
    )
    loss = ops.cast(loss, dtype)
    return loss, ops.reshape(losses, shape), ops.reshape(correct, shape)
