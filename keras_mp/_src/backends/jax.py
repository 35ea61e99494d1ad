"""JAX: a stateless step, compiled whole, skipped by `lax.cond` or by selects.

`fit` runs `LossScaleOptimizer.stateless_apply` inside its own `jax.jit`.
Outside a trace (`apply`, `fit(run_eagerly=True)`, a custom loop) the same
step is compiled once with `jax.jit`: run op by op, its `lax.cond` would be
traced and compiled again at every call.
"""

import keras

from keras_mp._src import keras_internals
from keras_mp._src.backends import common
from keras_mp._src.backends.common import *  # noqa: F401,F403 (the portable hooks)
from keras_mp._src.backends.jax_chunks import chunked_loss  # noqa: F401 (the hook)
from keras_mp._src.backends.jax_chunks import chunked_token_losses  # noqa: F401 (the hook)

STATELESS = True
OPENVINO_THROUGH_ONNX = True
SHARDS_OPTIMIZER_STATE = True


def skips_by_select():
    """Whether the step skips with selects instead of `lax.cond`: yes.

    The update is always computed and `jnp.where` keeps the old values of a
    skipped step, chosen as the inner optimizer assigns them
    (`common.stateless_step`), so XLA updates every slot in place. A
    `lax.cond` around the update costs memory on every platform: XLA gives
    the conditional's results buffers of their own, so a step held a second
    copy of the weights and slots it updates (on JAX's CPU 1.1x to 4x the
    temporaries of Keras's own `mixed_bfloat16` step, `benchmarks/README.md`,
    "How much memory does a train step hold?"), and on a GPU or TPU it reads
    its predicate on the host, which waits for the device once per step.
    Either way a skipped step leaves every value bit-identical.

    The environment variable `KERAS_MP_JAX_SKIP_FORM` ("cond" or "select")
    forces one form (the tests run both on every machine).
    """
    form = common.skip_form()
    return form != "cond"


# The most gradient values checked as one array (`all_finite`).
_CHECKED_AT_ONCE = 2**20


def all_finite(grads):
    """Whether every gradient value is finite: `all(isfinite(g))`, exact.

    No `cond`: a `cond` over the gradients gave them buffers of their own
    (1.16x the temporaries of Keras's policy's step on a small attention
    model, on JAX's CPU). Nor a shortcut on a CPU, where XLA runs this check
    unfused: float32 sums of the gradients overflow (they needed that
    `cond`), sums of each gradient times zero held 70 MiB more temporaries
    than this check on a BERT (555 against 485), and the largest and
    smallest value miss a nan (XLA's CPU max and min of 4096 or more
    float32 values drop it, openxla/xla#21461).
    """
    import jax.numpy as jnp

    grads = [common.dense_values(g) for g in grads if g is not None]
    if not grads:
        return jnp.asarray(True)
    if (
        len(grads) == 1
        or sum(g.size for g in grads) > _CHECKED_AT_ONCE
        or keras.distribution.distribution() is not None  # a check of each stays on its shards
    ):
        return common.exact_all_finite(grads)
    # A small model's gradients: one check of each dtype's, flattened end to
    # end. XLA's CPU runs each check as three kernels, whose launches cost
    # more than their reads here (the digits MLP's 8 gradients: 5 kernels
    # instead of 25, 0.14 ms against 0.21 ms); a large model's would hold
    # a flag for every value at once.
    flat = {}
    for g in grads:
        flat.setdefault(g.dtype, []).append(jnp.ravel(g))
    flags = [jnp.all(jnp.isfinite(jnp.concatenate(same))) for same in flat.values()]
    return flags[0] if len(flags) == 1 else jnp.all(jnp.stack(flags))


# -- the step ----------------------------------------------------------------


def apply(step, grads, trainable_variables, unscaled_by_caller):
    """Eager `apply`: the stateless step on the current values, then assign.

    JAX cannot assign variables inside `lax.cond`.
    """
    if unscaled_by_caller:
        raise ValueError(
            "`get_unscaled_gradients` followed by `apply` is a tf.keras 2 "
            "pattern that is supported on TensorFlow and PyTorch only. On "
            "JAX, pass the gradients of the scaled loss to `apply`."
        )
    built = list(step.built_variables)
    if [id(v) for v in trainable_variables] != [id(v) for v in built]:
        raise ValueError(
            "On the JAX backend, `apply` needs the same list of variables "
            "the optimizer was built with. Received "
            f"{len(trainable_variables)} variables; the optimizer was "
            f"built with {len(built)}."
        )
    optimizer_variables = list(step.optimizer_variables)
    new_trainable, new_optimizer = step.stateless_apply(
        [v.value for v in optimizer_variables], grads, [v.value for v in built]
    )
    for variable, value in zip(built, new_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer_variables, new_optimizer):
        variable.assign(value)


def stateless_step(step, optimizer_values, grads, trainable_values):
    return common.stateless_step(
        step, optimizer_values, grads, trainable_values, by_select=skips_by_select
    )


stateless_step.__doc__ = common.stateless_step.__doc__


SCALE_IN_A_STATELESS_SCOPE = (
    "On JAX, a `train_step` under `jax.jit` gets the optimizer's state as "
    "values: scale the loss where they are mapped to the optimizer's "
    "variables, as Keras's own step does:\n"
    "    mapping = list(zip(self.optimizer.variables, optimizer_variables))\n"
    "    with keras.StatelessScope(state_mapping=mapping):\n"
    "        loss = self.optimizer.scale_loss(loss)"
)


def read_scale(variable):
    """`loss_scale`'s value for `scale_loss`, and whether it is the step's own.

    In a `keras.StatelessScope` that maps the optimizer's variables (Keras's
    JAX step), the step's own traced value. Otherwise the variable's value
    now: right for an eager loop that `apply`s, a constant in a compiled
    step (which `stateless_apply` then warns of), and nothing at all inside
    `fit`, whose compiled step holds the state and empties the variables.
    """
    scope = keras_internals.stateless_scope()
    if scope is not None and scope.get_current_value(variable) is not None:
        return variable.value, True
    try:
        return variable.value, False
    except TypeError as error:  # Keras's JAX `fit` set its value aside
        raise ValueError(
            "LossScaleOptimizer.scale_loss cannot read the loss scale: inside "
            "`fit`, the optimizer's variables hold no value. " + SCALE_IN_A_STATELESS_SCOPE
        ) from error


def is_traced(value):
    import jax

    return isinstance(value, jax.core.Tracer)


def run_stateless(step_fn, cache, *args):
    """Under a trace, `step_fn` itself; with values, compiled once (`cache`)."""
    import jax

    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
        return step_fn(*args)
    if "compiled" not in cache:
        # Compiled once per shape and dtype of the arguments, as `fit`'s step is.
        cache["compiled"] = jax.jit(step_fn)
    return cache["compiled"](*args)


# -- the doctor and the device --------------------------------------------------


def float32_gradients(model, x, y, loss_fn, sample_weight):
    import jax

    non_trainable = [v.value for v in model.non_trainable_variables]

    def compute(trainable):
        # `stateless_call` hands its keywords to `call` as they are.
        kwargs = {"training": True} if keras_internals.call_takes_training(model) else {}
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, **kwargs)
        return loss_fn(y, y_pred, sample_weight)

    return jax.grad(compute)([v.value for v in model.trainable_variables])


def gpu_compute_capability():
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return None
    major, minor = str(gpus[0].compute_capability).split(".")
    return int(major), int(minor)


def gpu_name():
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return gpus[0].device_kind if gpus else None


def half_attention_needs_float32(dtype):
    """JAX's CPU backend has no float16 x float16 -> float32 `dot_general`."""
    import jax

    return dtype == "float16" and jax.default_backend() == "cpu"


def train_step_matmuls(model, data):
    """The matmuls of the HLO JAX lowers `fit`'s train step to (nothing
    compiled, nothing run)."""
    import jax

    from keras_mp._src.backends import hlo_text

    keras_internals.build_for_training(model, data)
    state = keras_internals.jax_training_state(model)
    lowered = jax.jit(model.train_step).lower(state, data)
    return hlo_text.census(lowered.as_text(dialect="hlo"))[0]


def train_step_largest(model, data):
    """The elements of the largest floating-point array in the HLO JAX
    lowers `fit`'s train step to (nothing compiled, nothing run)."""
    import jax

    from keras_mp._src.backends import hlo_text

    keras_internals.build_for_training(model, data)
    state = keras_internals.jax_training_state(model)
    lowered = jax.jit(model.train_step).lower(state, data)
    return hlo_text.largest_array(lowered.as_text(dialect="hlo"))


def train_step_memory(model, data):
    """`(held, None)`: XLA's temporary bytes of `fit`'s train step, compiled
    for this machine with its state donated, as `fit` compiles it (nothing
    run)."""
    import jax

    keras_internals.build_for_training(model, data)
    state = keras_internals.jax_training_state(model)
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    return compiled.memory_analysis().temp_size_in_bytes, None


def rounded(x, dtype):
    """bfloat16: `lax.reduce_precision`, a rounding XLA keeps under excess
    precision (a pair of converts it drops on a GPU). float16: the converts
    (`reduce_precision` flushes float16's subnormals to zero)."""
    import jax

    if keras.backend.standardize_dtype(dtype) != "bfloat16":
        return common.rounded(x, dtype)
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def computed_once(x):
    """On a CPU, `lax.optimization_barrier`: the master weights' select,
    written in place over the old copy, is what the half weight is cast
    from (fused again from the old copy, XLA's CPU compiler copied each
    master copy and weight first). XLA's GPU compiler copies neither (an
    H100, 2026-11-27) and fuses the cast into the update: no barrier there."""
    import jax

    return jax.lax.optimization_barrier(x) if jax.default_backend() == "cpu" else x


def saved_in_half(forward, backward, x, dtype):
    """`common.saved_in_half`, its backward pass written for XLA's CPU
    compiler, the same numbers. A float32 softmax kept in half in an
    attention with dropout, 4-layer BERT at O2 bfloat16, XLA's temporaries
    of `fit`'s step: 485 MiB against Keras's mixed_bfloat16 458 before, 461
    after (`benchmarks/README.md`, "How much memory does a train step
    hold?"). Two things held float32 copies across the step:

    - its scheduler cast each kept half output to float32 as soon as the
      forward pass made it, and held the float32 copy until the backward
      pass: the kept output is read after the upstream gradient exists
      (`lax.optimization_barrier`);
    - the backward pass's row sum became a YNNPACK fusion that took in the
      dropout's backward (`g * mask / keep`) but not the broadcast of its
      scalar: one float32 tensor of the probabilities' shape, made at the
      step's start and held to its end. The upstream gradient passes
      through a `lax.reduce_precision` of 8 exponent and 10 mantissa bits,
      which YNNPACK does not fuse: exact for every float16 and bfloat16
      value (subnormals included: an 8-bit exponent flushes nothing).

    Elsewhere the common form (a GPU's compiler fuses elementwise casts into
    their consumers; not measured there yet)."""
    import jax

    if jax.default_backend() != "cpu":
        return common.saved_in_half(forward, backward, x, dtype)

    def read_after(y, upstream):
        y, upstream = jax.lax.optimization_barrier((y, upstream))
        wide = jax.lax.convert_element_type(upstream, "float32")
        return y, jax.lax.reduce_precision(wide, exponent_bits=8, mantissa_bits=10)

    return common.saved_in_half(forward, backward, x, dtype, read_after=read_after)
