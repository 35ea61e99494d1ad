"""Matmuls in a traced TensorFlow graph (`backends/tf_graph.py`): each op
kind, forward and backward, and a `while` loop's body, counted by hand."""

import pytest

from tests.steps import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graphs")


def _graph(fn, *specs):
    import tensorflow as tf

    return tf.function(fn).get_concrete_function(*specs).graph


@pytest.mark.perf
def test_each_kind_of_matmul_and_its_gradients():
    import tensorflow as tf

    from keras_mp._src.backends import tf_graph

    def step(a, b, c, d, x, k):
        with tf.GradientTape() as tape:
            tape.watch([a, k])
            y = tf.matmul(a, b, transpose_b=True)  # [4,8] x [16,8]^T
            z = tf.matmul(c, d)  # batch matmul [2,4,8] x [2,8,3]
            e = tf.einsum("...ij,jk->...ik", c, tf.cast(b, c.dtype))  # [2,4,16] x [16,8]
            v = tf.nn.conv2d(x, k, 1, "SAME")  # [2,8,8,3] * [3,3,3,4]
            parts = (y, z, e, v)
            loss = tf.add_n([tf.reduce_sum(tf.cast(p, tf.float32)) for p in parts])
        return tape.gradient(loss, [a, k])

    spec = tf.TensorSpec
    graph = _graph(
        step,
        spec([4, 8], tf.float16),
        spec([16, 8], tf.float16),
        spec([2, 4, 16], tf.bfloat16),
        spec([2, 16, 3], tf.bfloat16),
        spec([2, 8, 8, 3], tf.float32),
        spec([3, 3, 3, 4], tf.float32),
    )
    found = tf_graph.matmuls(graph)
    kinds = sorted((kind, dtype, n) for kind, dtype, n in found)
    mm, conv = 2 * 4 * 16 * 8, 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)
    # Forward: y, z, e, v. Backward: y's gradient for a; as traced, Conv2D's
    # gradient function computes both its operands' (x's too, pruned only
    # when the graph runs).
    assert kinds == sorted(
        [("dot", "float16", mm)] * 2
        + [("dot", "bfloat16", 2 * 2 * 4 * 3 * 16), ("dot", "bfloat16", 2 * 2 * 4 * 8 * 16)]
        + [("convolution", "float32", conv)] * 3
    ), kinds


@pytest.mark.perf
def test_a_loop_body_counts_once():
    import tensorflow as tf

    from keras_mp._src.backends import tf_graph

    def loop(a, b):
        return tf.while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, tf.matmul(x, b)), (0, a))

    graph = _graph(loop, tf.TensorSpec([4, 8], tf.float32), tf.TensorSpec([8, 8], tf.float32))
    assert tf_graph.matmuls(graph) == [("dot", "float32", 2 * 4 * 8 * 8)]
