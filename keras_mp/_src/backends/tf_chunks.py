"""TensorFlow: a loss computed over chunks of tokens, with a gradient that
computes each chunk again (`precision/lm_loss.py` gives the arithmetic).

`tf.custom_gradient` over two `tf.while_loop`s, one iteration at a time
(`parallel_iterations=1`: TensorFlow's executor would otherwise run chunks
side by side, each with its logits). The rows are padded to whole chunks,
so that every iteration has the same shapes (XLA's `jit_compile` needs
them). The forward loop keeps nothing for a gradient (the custom one
replaces it); the backward loop carries the weights' float32 gradients and
writes each chunk's hidden-state gradient.
"""


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    import tensorflow as tf

    from keras_mp._src.backends import tensorflow as backend

    chunk = int(chunk)
    weights = [tf.convert_to_tensor(w) for w in weights]
    # XLA keeps float32 between half ops (excess precision): the head's own
    # ops round each result, so do the chunks' (`backend.rounded`).
    rounded = _rounded if backend.in_xla_context() else _as_is
    n = tf.shape(hidden)[0]
    count = (n + chunk - 1) // chunk
    labels_in_chunks = _split(labels, chunk, count, -1)

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


def matmul32(equation, a, b):
    """A half matmul with a float32 result, added across chunks in float32.
    With a GPU the half GEMM's (rounded to half once per chunk, as
    Liger-Kernel's); on a CPU a float32 GEMM of the half operands, exact
    products (its half GEMMs convert to float32 anyway, unless it has AMX)."""
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU"):
        return tf.cast(tf.einsum(equation, a, b), tf.float32)
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
