"""ZeRO stage 1: optimizer state sharded over the data-parallel replicas.

Mixed precision with float32 master weights costs, per parameter and on
every replica, 2 bytes of half weights, 4 of master copy and 8 of Adam's
slots. DeepSpeed's ZeRO stage 1 divides the master copies and optimizer
slots over the data-parallel replicas. Under `keras.distribution` on JAX
this is a layout: each master copy and slot gets its variable's layout
plus the distribution's batch axis on its first dimension that is not
split yet and that the batch axis divides. XLA's partitioner then
computes each replica's shard of the update and gathers the new weights;
the step's results are the unsharded step's, within float rounding.
Variables too small to split (scalars, a bias shorter than the replica
count) keep their layout.
"""

import contextlib
import functools

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals


def check_argument(shard_optimizer_state):
    """`shard_optimizer_state` as a bool; a clear error where it cannot apply."""
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(
            "`shard_optimizer_state` must be True or False. "
            f"Received: shard_optimizer_state={shard_optimizer_state!r}"
        )
    if shard_optimizer_state and not backends.current.SHARDS_OPTIMIZER_STATE:
        raise ValueError(
            "`shard_optimizer_state=True` shards the optimizer's state over "
            "`keras.distribution`'s batch axis, which the JAX backend has; "
            f"the {backends.current.NAME} backend has no `keras.distribution`. "
            "Use KERAS_BACKEND=jax, or shard_optimizer_state=False. Received: "
            f"shard_optimizer_state=True on the {backends.current.NAME} backend"
        )
    return shard_optimizer_state


def distribution():
    """The active `keras.distribution`, which sharding needs."""
    current = keras.distribution.distribution()
    if current is None or getattr(current, "batch_dim_name", None) is None:
        raise ValueError(
            "`shard_optimizer_state=True` shards the optimizer's state over the "
            "data-parallel replicas of a `keras.distribution` (`DataParallel`, or "
            "`ModelParallel` with a batch axis), and none is set: call "
            "`keras.distribution.set_distribution(...)` before the model and "
            "its optimizer are built. Received: keras.distribution.distribution()="
            f"{current!r}"
        )
    return current


def sharded_layout(variable, distribution):
    """`variable`'s layout with the batch axis on its first free dimension
    that the batch axis divides; its own layout where none does."""
    layout = keras_internals.variable_layout(variable)
    mesh = distribution.device_mesh
    batch = distribution.batch_dim_name
    shape = tuple(variable.shape)
    axes = list(getattr(layout, "axes", None) or (None,) * len(shape))
    if batch in axes:
        return layout
    replicas = mesh.shape[list(mesh.axis_names).index(batch)]
    for i, size in enumerate(shape):
        if axes[i] is None and size is not None and size >= replicas and size % replicas == 0:
            axes[i] = batch
            return keras.distribution.TensorLayout(axes, mesh)
    return layout


def layouts(inner_optimizer, shard_optimizer_state):
    """`(layout_of, context)` for building the optimizer's state: the layout
    of the state kept for a variable, and a context in which the inner
    optimizer builds its slots in it."""
    if not shard_optimizer_state:
        return keras_internals.variable_layout, contextlib.nullcontext()
    layout_of = functools.partial(sharded_layout, distribution=distribution())
    return layout_of, slots_laid_out(inner_optimizer, layout_of)


@contextlib.contextmanager
def slots_laid_out(optimizer, layout_of):
    """While the inner optimizer builds, the slots it makes for a variable
    (`add_variable_from_reference`: Adam's moments, SGD's momentum, EMA's
    averages) take `layout_of(variable)`, named as Keras names them."""

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        return optimizer.add_variable(
            shape=reference_variable.shape,
            initializer=initializer,
            dtype=reference_variable.dtype,
            name=f"{reference_variable.path.replace('/', '_')}_{name or 'var'}",
            layout=layout_of(reference_variable),
        )

    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
    try:
        yield
    finally:
        del optimizer.__dict__["add_variable_from_reference"]
