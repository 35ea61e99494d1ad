"""TensorFlow: a loss computed over chunks of tokens (`precision/lm_loss.py`
gives the arithmetic).

`tf.custom_gradient` over `tf.while_loop`s, one iteration at a time
(`parallel_iterations=1`: TensorFlow's executor would otherwise run chunks
side by side, each with its logits). The rows are padded to whole chunks,
so that every iteration has the same shapes (XLA's `jit_compile` needs
them). A reduced loss (`chunked_loss`): one loop computes each chunk's
loss and gradients (the weights' float32 gradients its carry); the
gradient multiplies them by its scalar. Each token's loss
(`chunked_token_losses`, `reduction="none"`): the forward loop keeps
nothing for a gradient (the custom one replaces it); the backward loop
computes each chunk again, carrying the weights' float32 gradients.
"""


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    import tensorflow as tf

    chunk = int(chunk)
    weights, rounded, n, count, labels_in_chunks = _prepared(hidden, labels, weights, chunk)

    @tf.custom_gradient
    def losses_of(hidden, *weights):
        ready = chunks.prepare(weights)
        hidden_in_chunks = _split(hidden, chunk, count, 0)

        def body(i, losses, lse, correct):
            parts = chunks.forward(hidden_in_chunks[i], labels_in_chunks[i], ready, rounded)
            return (i + 1,) + tuple(a.write(i, p) for a, p in zip((losses, lse, correct), parts))

        arrays = [tf.TensorArray(tf.float32, size=count, element_shape=[chunk]) for _ in range(3)]
        _, *arrays = tf.while_loop(
            lambda i, *_: i < count, body, [tf.constant(0)] + arrays, parallel_iterations=1
        )
        losses, lse, correct = (tf.reshape(a.stack(), [-1]) for a in arrays)

        def gradient(upstream, _=None):
            ready = chunks.prepare(weights)
            if upstream is None:
                upstream = tf.zeros([n], tf.float32)
            upstream_in_chunks = _split(upstream, chunk, count, 0)
            lse_in_chunks = tf.reshape(lse, [-1, chunk])

            def body(i, total, dh):
                dh_rows, grads = chunks.backward(
                    hidden_in_chunks[i],
                    labels_in_chunks[i],
                    lse_in_chunks[i],
                    upstream_in_chunks[i],
                    ready,
                    matmul32,
                    rounded,
                )
                total = [t + g for t, g in zip(total, grads)]
                return i + 1, total, dh.write(i, dh_rows)

            zeros = [tf.zeros(tf.shape(w), tf.float32) for w in weights]
            rows = tf.TensorArray(hidden.dtype, size=count, element_shape=[chunk, hidden.shape[1]])
            _, total, dh = tf.while_loop(
                lambda i, *_: i < count, body, [tf.constant(0), zeros, rows], parallel_iterations=1
            )
            dh = tf.reshape(dh.stack(), [-1, hidden.shape[1]])[:n]
            return [dh] + [tf.cast(t, w.dtype) for t, w in zip(total, weights)]

        return (losses[:n], tf.stop_gradient(correct[:n])), gradient

    return losses_of(hidden, *weights)


def chunked_loss(chunks, hidden, labels, share, prescale, weights, chunk):
    """`(loss, losses, correct)`: `sum(share * losses)` over the rows of
    `hidden`, each row's loss and argmax hit, `chunk` rows at a time."""
    import tensorflow as tf

    chunk = int(chunk)
    weights, rounded, n, count, labels_in_chunks = _prepared(hidden, labels, weights, chunk)
    share_in_chunks = _split(share, chunk, count, 0)

    @tf.custom_gradient
    def loss_of(hidden, *weights):
        ready = chunks.prepare(weights)
        hidden_in_chunks = _split(hidden, chunk, count, 0)

        def body(i, loss, total, losses, correct, dh):
            part, token_losses, hits, dh_rows, grads = chunks.with_gradients(
                hidden_in_chunks[i],
                labels_in_chunks[i],
                share_in_chunks[i],
                prescale,
                ready,
                matmul32,
                rounded,
            )
            total = [t + g for t, g in zip(total, grads)]
            return (
                i + 1,
                loss + part,
                total,
                losses.write(i, token_losses),
                correct.write(i, hits),
                dh.write(i, dh_rows),
            )

        zeros = [tf.zeros(tf.shape(w), tf.float32) for w in weights]
        arrays = [tf.TensorArray(tf.float32, size=count, element_shape=[chunk]) for _ in range(2)]
        rows = tf.TensorArray(tf.float32, size=count, element_shape=[chunk, hidden.shape[1]])
        _, loss, total, losses, correct, dh = tf.while_loop(
            lambda i, *_: i < count,
            body,
            [tf.constant(0), tf.constant(0.0), zeros] + arrays + [rows],
            parallel_iterations=1,
        )
        losses, correct = (tf.reshape(a.stack(), [-1])[:n] for a in (losses, correct))
        dh = tf.reshape(dh.stack(), [-1, hidden.shape[1]])[:n]

        def gradient(upstream, *_):
            safe = tf.where(prescale > 0, prescale, 1.0)
            factor = tf.where(prescale > 0, tf.cast(upstream, tf.float32) / safe, 0.0)
            return [tf.cast(dh * factor, hidden.dtype)] + [
                tf.cast(t * factor, w.dtype) for t, w in zip(total, weights)
            ]

        return (loss, tf.stop_gradient(losses), tf.stop_gradient(correct)), gradient

    return loss_of(hidden, *weights)


def _prepared(hidden, labels, weights, chunk):
    """`(weights, rounded, rows, chunks, labels in chunks)` for either loop."""
    import tensorflow as tf

    from keras_mp._src.backends import tensorflow as backend

    # XLA keeps float32 between half ops (excess precision): the head's own
    # ops round each result, so do the chunks' (`backend.rounded`).
    rounded = _rounded if backend.in_xla_context() else _as_is
    n = tf.shape(hidden)[0]
    count = (n + chunk - 1) // chunk
    weights = [tf.convert_to_tensor(w) for w in weights]
    return weights, rounded, n, count, _split(labels, chunk, count, -1)


def matmul32(equation, a, b):
    """A matmul with a float32 result (the chunks' gradients are added in
    float32): of half operands in float32 (exact products; on a CPU they
    come in float32 already, `lm_loss.gemm_dtype`)."""
    import tensorflow as tf

    return tf.einsum(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32))


def _rounded(x):
    import tensorflow as tf

    from keras_mp._src.backends import tensorflow as backend

    if x.dtype.name not in ("bfloat16", "float16"):
        return x
    return tf.cast(backend.rounded(tf.cast(x, tf.float32), x.dtype.name), x.dtype)


def _as_is(x):
    return x


def _split(x, chunk, count, fill):
    """`x`'s rows as `[count, chunk, ...]`, the last chunk padded with `fill`."""
    import tensorflow as tf

    pad = count * chunk - tf.shape(x)[0]
    paddings = [[0, pad]] + [[0, 0]] * (len(x.shape) - 1)
    x = tf.pad(x, paddings, constant_values=tf.cast(fill, x.dtype))
    return tf.reshape(x, tf.concat([[count, chunk], tf.shape(x)[1:]], 0))
