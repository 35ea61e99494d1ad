"""tf.distribute: one decision across replicas, the strategies refused.

A replica's NaN must skip the step on every replica (one all-reduce of a
scalar), and where the inner optimizer calls `merge_call` the decision is
taken in the cross-replica context, as Keras's built-in takes it. The
strategies and compilations the loss-scale step cannot run under are
refused at `compile` (`check_compile`) and at the step, with the way out.
"""

XLA_ACROSS_REPLICAS_MESSAGE = (
    "keras_mp.LossScaleOptimizer cannot run in an XLA-compiled step "
    "(`jit_compile=True`) under a tf.distribute strategy with more than one "
    "replica: the decision to skip a step is taken across replicas, in "
    "TensorFlow's cross-replica context (`merge_call`), which XLA-compiled "
    "functions do not support (Keras's built-in LossScaleOptimizer crashes "
    "there with a `merge_call` RuntimeError, keras-team/keras#21366; Keras "
    "itself turns XLA off under tf.distribute with jit_compile='auto'). Workarounds: "
    "compile with `jit_compile=False` (or 'auto'); or use the JAX backend with "
    "`keras.distribution.DataParallel`, where XLA compiles the whole step, skip included."
)


def all_replicas_agree(finite):
    """The step is finite only if it is finite on every replica.

    Under a strategy each replica sees its own gradients before the inner
    optimizer all-reduces them: a NaN on one replica must skip the step on
    all of them, and every replica must update its copy of the state the same
    way, or the replicas silently diverge. One all-reduce of a scalar.
    """
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return finite
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    bad = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), "float32"))
    return tf.equal(bad, 0.0)


def check_not_xla_across_replicas(in_xla):
    """Refuses a step XLA compiles (`in_xla`) across more than one replica."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or not in_xla:
        return
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        raise RuntimeError(XLA_ACROSS_REPLICAS_MESSAGE)


def check_strategy(strategy):
    """Refuses the strategies the loss-scale step cannot run under."""
    if type(strategy).__name__ == "CentralStorageStrategy" and strategy.num_replicas_in_sync > 1:
        raise ValueError(
            "keras_mp.LossScaleOptimizer does not support "
            "tf.distribute.experimental.CentralStorageStrategy with more than "
            "one replica: its variables live on the parameter device, and "
            "each replica would update the loss-scale state on its own (Keras's "
            "built-in LossScaleOptimizer fails there too). Use "
            "tf.distribute.MirroredStrategy, or the JAX backend with "
            "keras.distribution.DataParallel. Received: "
            f"CentralStorageStrategy with {strategy.num_replicas_in_sync} replicas"
        )


def check_compile(model):
    """At `compile`: the strategy, and XLA across replicas."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    check_strategy(strategy)
    if model.jit_compile is True and strategy.num_replicas_in_sync > 1:
        raise ValueError(
            XLA_ACROSS_REPLICAS_MESSAGE
            + f" Received: jit_compile=True with {type(strategy).__name__} "
            f"({strategy.num_replicas_in_sync} replicas)"
        )


def apply_across_replicas(step, finite, replica_grads, trainable_variables):
    """Applies each replica's own (unscaled) gradients where the step is
    finite on every replica, from the cross-replica context: the inner
    optimizer calls `merge_call`, which a `cond` in a replica context cannot
    contain. The gradients travel through `merge_call`'s arguments, and the
    inner optimizer all-reduces them."""
    import tensorflow as tf

    def apply_replica_grads(replica_grads):
        step.apply_inner(list(replica_grads), trainable_variables)

    def cross_replica(distribution, finite, per_replica_grads):
        # Every replica holds the same global decision: take the first.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_fn():
            distribution.extended.call_for_each_replica(
                apply_replica_grads, args=(per_replica_grads,)
            )

        tf.cond(finite, apply_fn, lambda: None)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(finite, tuple(replica_grads))
    )
