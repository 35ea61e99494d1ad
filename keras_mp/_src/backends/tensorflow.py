"""TensorFlow: a stateful step in a graph, a `tf.cond` skip.

The step reads the state, checks the gradients, and decides with `tf.cond`
on the device; under XLA the conditional stays a real one on a CPU, half
gradients entering it narrow (`docs/design.md`). Under a strategy every
replica takes the same decision (`tf_distribute`).
"""

import math

import keras
from keras import ops

from keras_mp._src import keras_internals
from keras_mp._src.backends import common
from keras_mp._src.backends import tf_distribute
from keras_mp._src.backends.common import *  # noqa: F401,F403 (the portable hooks)
from keras_mp._src.backends.tf_chunks import chunked_loss  # noqa: F401 (the hook)
from keras_mp._src.backends.tf_chunks import chunked_token_losses  # noqa: F401 (the hook)
from keras_mp._src.backends.tf_distribute import check_compile  # noqa: F401 (the hook)
from keras_mp._src.optimizer.loss_scale import update

# -- gradients ---------------------------------------------------------------


def in_xla_context():
    """Whether the op being built goes to XLA (`jit_compile=True`)."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # A TensorFlow without these internals: graph form.
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph())


def add_all(tensors):
    import tensorflow as tf

    return tensors[0] if len(tensors) == 1 else tf.add_n(tensors)  # one op, not a chain


def exact_all_finite(grads):
    """`all(isfinite(g))`; under XLA over rows of 8 values.

    XLA's CPU backend writes `isfinite(g)` out and reduces it in windows; over
    rows of 8 the windows reduce about twice as fast as over a layer's own
    shape. The reshape is free (a bitcast); the answer is the same.
    """
    if in_xla_context():
        grads = [_rows_of_eight(g) for g in grads]
    return common.exact_all_finite(grads)


def _rows_of_eight(g):
    shape = tuple(g.shape)
    if any(d is None for d in shape):
        return g
    size = math.prod(shape)
    if size == 0 or size % 8:
        return g
    return ops.reshape(g, (size // 8, 8))


def all_finite(grads):
    return common.all_finite(grads, exact=exact_all_finite, add=add_all)


all_finite.__doc__ = common.all_finite.__doc__


def with_values(indexed_slices, values):
    import tensorflow as tf

    return tf.IndexedSlices(values, indexed_slices.indices, indexed_slices.dense_shape)


def unscale(grads, scale, skip=(), keep_dtype=False):
    return common.unscale(grads, scale, skip, keep_dtype, with_values=with_values)


unscale.__doc__ = common.unscale.__doc__


def keep_conditional(scale):
    """XLA on a CPU: keeps the skip a real conditional.

    XLA's conditional simplifier turns a `cond` whose branches hold only
    elementwise ops (an optimizer's update is) into selects: the update then
    runs on every step, and since the old weights and slots must survive
    until the select, they are copied first. An optimization barrier on the
    scale, inside the branch that applies the step, is not elementwise, so
    the simplifier leaves the conditional alone; it passes one scalar.

    Only where the step runs on a CPU: on a GPU an XLA conditional may wait
    for its predicate on the host, which the selects avoid. Elsewhere, and
    on a TensorFlow without the op, `scale` comes back as it is.
    """
    if not in_xla_context():
        return scale
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"):
        return scale
    try:
        from tensorflow.compiler.tf2xla.python import xla
    except ImportError:
        return scale
    barrier = getattr(xla, "optimization_barrier", None)
    return scale if barrier is None else barrier(scale)[0]


def narrow_origins(grads):
    """Under XLA: the float16/bfloat16 tensor each gradient was cast from.

    Under a mixed policy the gradient of a float32 variable is the float32
    cast of a half gradient. XLA fuses that cast into the optimizer's update
    kernels, unless the gradient is an operand of the skip's conditional:
    then the float32 gradient is written out in full before it, one more pass
    over every gradient. So the check reads the narrow tensor and the
    applying branch casts it up again (`widen`): the same values, since
    widening a float16 or bfloat16 value to float32 is exact. Elsewhere each
    gradient comes back as it is.
    """
    if not in_xla_context():
        return list(grads)
    return [_narrow_origin(g) for g in grads]


def _narrow_origin(grad):
    if grad is None or common.is_indexed_slices(grad) or grad.dtype.name != "float32":
        return grad
    op = getattr(grad, "op", None)
    if op is None or op.type != "Cast" or len(op.inputs) != 1:
        return grad
    source = op.inputs[0]
    return source if source.dtype.name in ("float16", "bfloat16") else grad


def widen(origins, grads):
    """The gradients again, from `narrow_origins(grads)`: casts the narrow ones up."""
    return [
        grad if origin is grad else ops.cast(origin, grad.dtype)
        for origin, grad in zip(origins, grads)
    ]


# -- the step ----------------------------------------------------------------


def apply(step, grads, trainable_variables, unscaled_by_caller):
    """One step: check, decide with `tf.cond`, apply or skip, store the state."""
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context.")
    tf_distribute.check_strategy(tf.distribute.get_strategy())
    tf_distribute.check_not_xla_across_replicas(in_xla_context())
    state = common.read_state(step)
    config = step.config

    def unscaled(grads, scale):
        if unscaled_by_caller:
            return grads
        of_grads = common.scale_of_grads(step, scale)
        if of_grads is None and not in_xla_context():
            # Nothing to unscale (bfloat16's fixed 1), but the gradients must
            # pass through an op inside the branch (a bare capture fails
            # TensorFlow's gradient bookkeeping at O3): an Identity, which
            # copies nothing, where a multiply by 1 wrote every gradient out
            # again (a ResNet50's 94 MB a step).
            return _passed_through(unscale(grads, None, skip=step.skip), step.skip)
        if of_grads is None:
            # Under XLA on a CPU the barrier (`keep_conditional`) must feed
            # an op of the branch; x / x is 1, and XLA fuses the multiply
            # into the update.
            of_grads = ops.divide(scale, scale)
        return unscale(grads, of_grads, skip=step.skip)

    # Under XLA, gradients cast up from half precision enter the skip's
    # branches as the half tensors they were cast from.
    origins = narrow_origins(grads)

    def on_finite():
        scale = keep_conditional(state.scale)
        step.apply_inner(unscaled(widen(origins, grads), scale), trainable_variables)
        common.assign_state(step, state, update(state, True, config))

    def on_overflow():
        common.assign_state(step, state, update(state, False, config))

    if not config.checks_finite:
        on_finite()
        return
    finite = tf_distribute.all_replicas_agree(step.check_finite(origins))
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        # Inside each branch the outcome is known, so `update` builds only
        # that outcome's few ops.
        tf.cond(finite, on_finite, on_overflow)
        return
    # The inner optimizer calls `merge_call`: decide across replicas.
    tf_distribute.apply_across_replicas(
        step, finite, unscaled(grads, state.scale), trainable_variables
    )
    common.assign_state(step, state, update(state, finite, config))


def _passed_through(grads, skip):
    import tensorflow as tf

    def identity(g):
        if common.is_indexed_slices(g):
            return with_values(g, tf.identity(g.values))
        return tf.identity(g)

    return [g if g is None or i in skip else identity(g) for i, g in enumerate(grads)]


def check_stateless():
    raise ValueError(
        "stateless_apply is not supported with the TensorFlow backend "
        "(as it is incompatible with tf.distribute). Use `apply`."
    )


def log_value(variable):
    # A tensor, not the `tf.Variable` that `.value` is: eager `fit`
    # (`run_eagerly=True`) passes the logs through a `tf.data` Optional,
    # which cannot hold a variable.
    import tensorflow as tf

    return tf.identity(variable.value)


def as_the_optimizer_sees(variable):
    # Keras's TensorFlow optimizer decays the `tf.Variable`s: its weight
    # decay's name patterns judge their names (the path, and ":0").
    return variable.value


def outside_the_step():
    import tensorflow as tf

    return tf.init_scope()


# -- the doctor and the device --------------------------------------------------


def float32_gradients(model, x, y, loss_fn, sample_weight):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True), sample_weight)
    return tape.gradient(loss, model.trainable_variables)


def gpu_compute_capability():
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    return tuple(details.get("compute_capability", (0, 0)))


def gpu_name():
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name")


def train_step_matmuls(model, data):
    """The matmuls of the graph `tf.function` traces of the train step
    (nothing run)."""
    from keras_mp._src.backends import tf_graph

    return tf_graph.matmuls(train_step_graph(model, data))


def train_step_graph(model, data):
    """The graph `tf.function` traces of the train step (nothing run)."""
    import tensorflow as tf

    keras_internals.build_for_training(model, data)
    spec = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), data)
    return tf.function(model.train_step).get_concrete_function(spec).graph


def train_step_largest(model, data):
    """The elements of the largest floating-point tensor in the graph
    `tf.function` traces of the train step (nothing run)."""
    import tensorflow as tf

    from keras_mp._src.backends import tf_graph

    keras_internals.build_for_training(model, data)
    spec = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), data)
    return tf_graph.largest_tensor(tf.function(model.train_step).get_concrete_function(spec).graph)


def train_step_memory(model, data):
    """`(None, saved)`: the bytes by dtype of the forward values the
    gradient's ops read in the graph `tf.function` traces of the train step
    (nothing run)."""
    import tensorflow as tf

    from keras_mp._src.backends import tf_graph

    keras_internals.build_for_training(model, data)
    spec = tf.nest.map_structure(lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), data)
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    return None, tf_graph.saved_for_backward(graph)


def rounded(x, dtype):
    """bfloat16: to nearest even on the bits, integer arithmetic XLA keeps
    (a pair of converts it drops on a GPU); NaN and infinities as they are."""
    import tensorflow as tf

    if keras.backend.standardize_dtype(dtype) != "bfloat16":
        return common.rounded(x, dtype)
    bits = tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32)
    odd = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16), 1)
    up = tf.bitcast(tf.bitwise.bitwise_and(bits + 0x7FFF + odd, 0xFFFF0000), tf.float32)
    return tf.where(tf.math.is_finite(x), up, x)
