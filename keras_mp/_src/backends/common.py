"""What every backend shares: the portable form of each backend hook.

Each backend module (`tensorflow`, `jax`, `torch`) starts from these and
replaces the ones its execution model does differently. Every function has a
portable `keras.ops` meaning; none brings a value to the host unless said.
"""

import contextlib
import os

import keras
from keras import ops

from keras_mp._src.backends.gradients import *  # noqa: F401,F403 (the gradients' hooks)
from keras_mp._src.backends.gradients import scale_of_grads
from keras_mp._src.backends.gradients import unscale
from keras_mp._src.optimizer.loss_scale import LossScaleState
from keras_mp._src.optimizer.loss_scale import update

NAME = keras.backend.backend()  # this process's Keras backend

# `fit` and `stateless_apply` are functions of values (JAX) rather than of
# variables updated in place (TensorFlow, PyTorch).
STATELESS = False
# Whether `keras.distribution` can shard the optimizer state (`zero.py`).
SHARDS_OPTIMIZER_STATE = False
# Whether a train step runs eagerly, once per step (PyTorch): a failed step
# can be run again after keeping the failing layers in float32.
EAGER_STEP = False
# `model.export(format="tf_saved_model")` works from this backend.
EXPORTS_SAVED_MODEL = True
# `model.export(format="openvino")` fails from this backend (JAX: OpenVINO
# has no rule for jax2tf's `XlaCallModule`): keras_mp exports ONNX, which
# OpenVINO reads, and converts that.
OPENVINO_THROUGH_ONNX = False

# A float32 norm keeps its half inputs, recomputed (`precision/recomputed.py`).
RECOMPUTES_FROM_HALF = False
# O3's half gradients taken in float32 as the backward pass makes them (PyTorch).
Float32Grads = None
# The documented switch of the JAX step's form (`backends.jax.skips_by_select`).
SKIP_FORM_VARIABLE = "KERAS_MP_JAX_SKIP_FORM"


def skip_form():
    """`KERAS_MP_JAX_SKIP_FORM`: "cond", "select", or None (by platform)."""
    form = os.environ.get(SKIP_FORM_VARIABLE) or None
    if form not in (None, "cond", "select"):
        raise ValueError(
            f"{SKIP_FORM_VARIABLE} must be 'cond', 'select' or unset. "
            f"Received: {SKIP_FORM_VARIABLE}={form!r}"
        )
    return form


def skips_by_select():
    """Whether the stateless step skips with selects instead of a `cond`."""
    return False


# -- gradients ---------------------------------------------------------------


# -- the step ----------------------------------------------------------------


def read_state(step):
    """The step's `LossScaleState`, from its variables."""
    return LossScaleState(*(v.value for v in step.variables))


def assign_state(step, old_state, new_state):
    """Stores what `update` returned; unchanged entries are not written."""
    for variable, old, new in zip(step.variables, old_state, new_state):
        if new is not old:
            variable.assign(new)


def apply(step, grads, trainable_variables, unscaled_by_caller):
    """One loss-scaled step on variables (see `loss_scale.Step`).

    Returns whether it applied the gradients, a Python bool, where the
    backend decides on the host (PyTorch); None where a tensor decides.
    """
    raise NotImplementedError(f"keras_mp's LossScaleOptimizer does not support the {NAME} backend.")


def stateless_step(step, optimizer_values, grads, trainable_values, by_select=None):
    """`LossScaleOptimizer.stateless_apply`'s step, on checked arguments.

    Returns `(new_trainable_values, new_optimizer_values)`. A skipped step
    returns the values it was given. Where the backend skips by selects
    (`skips_by_select`), both outcomes are computed and `where` keeps the
    chosen one's (NaN from a bad gradient dropped, kept values bit-exact);
    otherwise `ops.cond` runs one. `by_select`: the backend's
    `skips_by_select`.
    """
    own_values = optimizer_values[: step.own_count]
    inner_values = optimizer_values[step.own_count :]
    start = step.state_index
    state = LossScaleState(*own_values[start : start + 3])

    def own_values_for(own_values, new_state):
        new_own = list(own_values)
        for i, (variable, value) in enumerate(zip(step.variables, new_state)):
            new_own[start + i] = ops.cast(value, variable.dtype)
        return new_own

    def on_finite(kept=None):
        unscaled = unscale(grads, scale_of_grads(step, state.scale), skip=step.skip)
        new_trainable, new_own, new_inner = step.inner_stateless_apply(
            own_values, inner_values, unscaled, trainable_values, kept=kept
        )
        finite = True if kept is None else kept
        new_own = own_values_for(new_own, update(state, finite, step.config))
        return list(new_trainable), new_own + list(new_inner)

    def on_overflow():
        new_own = own_values_for(own_values, update(state, False, step.config))
        return list(trainable_values), new_own + list(inner_values)

    if not step.config.checks_finite:
        return on_finite()
    finite = step.check_finite(grads)
    if (by_select or skips_by_select)():
        # Every value is chosen as it is assigned: the inner optimizer's
        # (its update reads its new slots as it writes them, as in the plain
        # step; selected afterwards, XLA copies every slot first), the master
        # copies (a trainable value with a copy is the copy's rounding, the
        # same bits when the copy is kept), and the loss-scale state, whose
        # transition is selects of `finite`.
        return on_finite(kept=finite)
    return ops.cond(finite, on_finite, on_overflow)


def read_scale(variable):
    """The loss scale for `scale_loss`, and whether it is the step's own.

    Stateful backends read the variable itself (traced as a variable, so the
    compiled step sees each step's scale).
    """
    return variable, True


def check_stateless():
    """Refuses `stateless_apply` where the backend's step is stateful-only."""


def run_stateless(step_fn, cache, *args):
    """Runs the stateless step (`LossScaleOptimizer.stateless_apply`)."""
    return step_fn(*args)


def log_value(variable):
    """The variable's value after the step, for `fit`'s logs."""
    return variable.value


def check_compile(model):
    """Refuses, at `compile`, what this backend's step cannot run under."""


def outside_the_step():
    """A context in which assignments run now, once, even where the step
    being traced builds the optimizer (TensorFlow's `tf.init_scope`)."""
    return contextlib.nullcontext()


# -- the doctor and the device --------------------------------------------------


def float32_gradients(model, x, y, loss_fn, sample_weight):
    """Gradients of the loss with respect to `model.trainable_variables`."""
    raise NotImplementedError(f"keras_mp.analyze does not support the {NAME} backend.")


def gpu_compute_capability():
    """`(major, minor)` of the first GPU this backend sees, or None."""
    return None


def gpu_name():
    """The first GPU's name from its driver ("NVIDIA H100 80GB HBM3"), or None."""
    return None


def half_attention_needs_float32(dtype):
    """Whether Keras's attention cannot compute in `dtype` here (JAX's CPU)."""
    return False


def computes_half_matmuls(dtype):
    """Whether Keras's matmuls compute in the half `dtype` on this device
    (Keras's PyTorch backend runs float16 matmuls in float32 on a CPU)."""
    return True


# -- layers and optimizers -----------------------------------------------------


def variables_changed(model):
    """After variables of `model` were recast in place (O3's half weights):
    what the backend registers by object must learn the new ones."""


def as_the_optimizer_sees(variable):
    """`variable` as an optimizer's step passes it to `_use_weight_decay` (name patterns)."""
    return variable


def step_each_variable(optimizer):
    """Makes `optimizer` step each variable through its `update_step`, where
    the backend fuses the update of all of them (compensated updates)."""


def rounded(x, dtype):
    """`x` (float32) rounded to half `dtype`, in float32 (compensated updates). XLA's GPU
    compiler drops a pair of converts under excess precision: JAX and TF round otherwise."""
    return ops.cast(ops.cast(x, dtype), "float32")


def computed_once(x):
    """`x`, computed once and read back by each consumer (JAX: XLA would compute
    it again inside each, and copy the buffers they write in place first)."""
    return x


# -- the compiled program ---------------------------------------------------------


def train_step_matmuls(model, data):
    """`(kind, dtype, flops)` of each matmul and convolution in the program
    this backend runs for `model`'s train step on the batch `data` (`(x, y)`):
    JAX's lowered HLO, TensorFlow's traced graph, PyTorch's dispatched ops."""
    raise NotImplementedError(f"keras_mp reads no train step program on the {NAME} backend")


def train_step_memory(model, data):
    """`(held, saved)`: the bytes `model`'s train step on `data` holds at its
    peak (or None), and `{dtype: bytes}` it keeps for the backward pass (or
    None), as far as this backend exposes them (`compiled_census.memory`)."""
    raise NotImplementedError(f"keras_mp reads no train step program on the {NAME} backend")


train_step_largest = train_step_memory  # the elements of its largest tensor


# -- probabilities kept in half ------------------------------------------------


def saved_in_half(forward, backward, x, dtype, read_after=None):
    """`forward(x)` (float32 arithmetic) returned in `dtype`; its gradient is
    `backward(y, upstream)` on the half `y` read in float32, the one value kept
    (as Megatron's and Apex's fused softmax; `custom_gradient` keeps what its
    `grad` refers to). `read_after(y, upstream)`: both as a compiler should
    read them (`backends.jax`)."""

    @ops.custom_gradient
    def kept_in_half(x):
        y = ops.cast(forward(x), dtype)

        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            kept, upstream = (y, upstream) if read_after is None else read_after(y, upstream)
            dx = backward(ops.cast(kept, "float32"), ops.cast(upstream, "float32"))
            return ops.cast(dx, x.dtype)

        return y, grad

    return kept_in_half(x)


def chunked_loss(chunks, hidden, labels, share, prescale, weights, chunk):
    """A reduced loss chunk by chunk (`lm_loss.py`): `jax_chunks`, `torch_chunks`, `tf_chunks`."""
    raise NotImplementedError(f"keras_mp has no chunked loss on the {NAME} backend")


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """A loss chunk by chunk (`lm_loss.py`): `jax_chunks`, `torch_chunks`, `tf_chunks`."""
    raise NotImplementedError(f"keras_mp has no chunked loss on the {NAME} backend")


def recomputed_from_half(function, inputs, weights):
    """`function(*inputs)`; recomputed from half `inputs` where autograd saves what it reads."""
    return function(inputs, weights)
