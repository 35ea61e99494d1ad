"""JAX: a loss computed over chunks of tokens (`precision/lm_loss.py`
gives the arithmetic).

`jax.custom_vjp`, two forms. A reduced loss (`chunked_loss`): the forward
pass scans the chunks once, computing each chunk's loss and its gradients
(the weights' float32 gradients the scan's carry) and keeps the gradients;
the backward pass multiplies them by its scalar. Each token's loss
(`chunked_token_losses`, `reduction="none"`): the forward pass maps the
chunks with `lax.map` and keeps the hidden states, the labels, the weights
(inputs all three) and a float32 log-sum-exp per token; the backward pass
scans the chunks again with the weights' float32 gradients as its carry.
XLA sees one chunk's logits at a time, in the loop's body.
"""

import functools


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    return _custom(chunks, int(chunk))(hidden, labels, tuple(weights))


def chunked_loss(chunks, hidden, labels, share, prescale, weights, chunk):
    """`(loss, losses, correct)`: `sum(share * losses)` over the rows of
    `hidden`, each row's loss and argmax hit, `chunk` rows at a time."""
    return _custom_loss(chunks, int(chunk))(hidden, labels, share, prescale, tuple(weights))


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


@functools.lru_cache(maxsize=None)
def _custom_loss(chunks, chunk):
    import jax
    import jax.numpy as jnp

    def forward_all(hidden, labels, share, weights):
        ready = chunks.prepare(weights)
        n = hidden.shape[0]

        def one(xs):
            losses, _, correct = chunks.forward(xs[0], xs[1], ready, rounded)
            return jnp.sum(losses * xs[2]), losses, correct

        loss, losses, correct = jax.lax.map(
            one, (_split(hidden, chunk, 0), _split(labels, chunk, -1), _split(share, chunk, 0))
        )
        return jnp.sum(loss), losses.reshape(-1)[:n], correct.reshape(-1)[:n]

    @jax.custom_vjp
    def loss_of(hidden, labels, share, prescale, weights):
        loss, losses, correct = forward_all(hidden, labels, share, weights)
        return loss, jax.lax.stop_gradient(losses), jax.lax.stop_gradient(correct)

    def forward(hidden, labels, share, prescale, weights):
        ready = chunks.prepare(weights)
        n = hidden.shape[0]

        def one(total, xs):
            loss, losses, correct, dh, grads = chunks.with_gradients(
                *xs, prescale, ready, matmul32, rounded
            )
            return tuple(t + g for t, g in zip(total, grads)), (loss, losses, correct, dh)

        zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in weights)
        xs = (_split(hidden, chunk, 0), _split(labels, chunk, -1), _split(share, chunk, 0))
        total, (loss, losses, correct, dh) = jax.lax.scan(one, zeros, xs)
        dh = dh.reshape((-1, hidden.shape[1]))[:n]
        outputs = (jnp.sum(loss), losses.reshape(-1)[:n], correct.reshape(-1)[:n])
        # The dtypes to give back, as empty arrays (residuals are arrays).
        dtypes = tuple(jnp.zeros((0,), x.dtype) for x in (hidden,) + tuple(weights))
        return outputs, (dh, total, prescale, dtypes)

    def backward(saved, cotangents):
        dh, total, prescale, dtypes = saved
        factor = jnp.where(prescale > 0, cotangents[0] / jnp.where(prescale > 0, prescale, 1), 0)
        dh = (dh * factor).astype(dtypes[0].dtype)
        grads = tuple((t * factor).astype(d.dtype) for t, d in zip(total, dtypes[1:]))
        return dh, None, None, None, grads

    loss_of.defvjp(forward, backward)
    return loss_of
