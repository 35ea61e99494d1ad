"""JAX: a loss computed over chunks of tokens, with a gradient that
computes each chunk again (`precision/lm_loss.py` gives the arithmetic).

`jax.custom_vjp`: the forward pass maps the chunks with `lax.map` and keeps
the hidden states, the labels, the weights (inputs all three) and a float32
log-sum-exp per token; the backward pass scans the chunks again with the
weights' float32 gradients as its carry. XLA sees one chunk's logits at a
time, in the loop's body.
"""

import functools


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    return _custom(chunks, int(chunk))(hidden, labels, tuple(weights))


def matmul32(equation, a, b):
    """A half matmul with a float32 result (XLA accumulates in float32)."""
    import jax.numpy as jnp

    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def rounded(x):
    """A half value rounded to its dtype: XLA would keep float32 between
    the logits' half ops (excess precision), not the values the head's
    own ops give (`lax.reduce_precision` is a rounding it keeps)."""
    import jax

    bits = {"bfloat16": (8, 7), "float16": (5, 10)}.get(str(x.dtype))
    return x if bits is None else jax.lax.reduce_precision(x, *bits)


def _split(x, chunk, fill):
    """`x`'s rows as `[chunks, chunk, ...]`, the last chunk padded with `fill`."""
    import jax.numpy as jnp

    pad = -x.shape[0] % chunk
    if pad:
        x = jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])
    return x.reshape((-1, chunk) + x.shape[1:])


@functools.lru_cache(maxsize=None)
def _custom(chunks, chunk):
    import jax
    import jax.numpy as jnp

    def forward_all(hidden, labels, weights):
        ready = chunks.prepare(weights)
        n = hidden.shape[0]

        def one(xs):
            return chunks.forward(xs[0], xs[1], ready, rounded)

        losses, lse, correct = jax.lax.map(
            one, (_split(hidden, chunk, 0), _split(labels, chunk, -1))
        )
        return losses.reshape(-1)[:n], lse.reshape(-1)[:n], correct.reshape(-1)[:n]

    @jax.custom_vjp
    def losses_of(hidden, labels, weights):
        losses, _, correct = forward_all(hidden, labels, weights)
        return losses, jax.lax.stop_gradient(correct)

    def forward(hidden, labels, weights):
        losses, lse, correct = forward_all(hidden, labels, weights)
        return (losses, correct), (hidden, labels, weights, lse)

    def backward(saved, cotangents):
        hidden, labels, weights, lse = saved
        upstream = cotangents[0]
        ready = chunks.prepare(weights)

        def one(total, xs):
            dh, grads = chunks.backward(*xs, ready, matmul32, rounded)
            return tuple(t + g for t, g in zip(total, grads)), dh

        zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in weights)
        xs = (
            _split(hidden, chunk, 0),
            _split(labels, chunk, -1),
            # Padding rows: exp(z - lse) is 0 there, whatever their logits.
            _split(lse, chunk, 3e38),
            _split(upstream, chunk, 0),
        )
        total, dh = jax.lax.scan(one, zeros, xs)
        dh = dh.reshape((-1, hidden.shape[1]))[: hidden.shape[0]]
        grads = tuple(t.astype(w.dtype) for t, w in zip(total, weights))
        return dh, None, grads

    losses_of.defvjp(forward, backward)
    return losses_of
