"""PyTorch: eager steps, one flag read per step, as `torch.amp.GradScaler`.

The check and the unscaling are one fused kernel
(`_amp_foreach_non_finite_check_and_unscale_`, behind `GradScaler.unscale_`);
its flag is read on the host to decide whether to run the inner optimizer,
and the state is updated with in-place torch ops that mirror
`loss_scale.update` (the tests drive both through every transition).
"""

import contextlib
import functools
import weakref

import keras

from keras_mp._src import keras_internals
from keras_mp._src.backends import common
from keras_mp._src.backends.common import *  # noqa: F401,F403 (the portable hooks)
from keras_mp._src.backends.torch_chunks import chunked_loss  # noqa: F401 (the hook)
from keras_mp._src.backends.torch_chunks import chunked_token_losses  # noqa: F401 (the hook)

EXPORTS_SAVED_MODEL = False
EAGER_STEP = True
RECOMPUTES_FROM_HALF = True


def unscale_and_check(grads, scale, skip=()):
    """Unscale and check finiteness in one fused kernel.

    Like `GradScaler.unscale_`, float32 gradients are unscaled in place;
    others are first copied to float32. Gradients at `skip` indices are only
    checked.

    Returns:
        `(unscaled_grads, found_inf)` where `found_inf` is a float32 tensor of
        shape `(1,)` on the gradients' device, 1.0 if any value was inf or nan.
    """
    import torch

    scale = scale.value if hasattr(scale, "value") else scale
    found_inf = torch.zeros((1,), dtype=torch.float32, device=scale.device)
    inv_scale = torch.reciprocal(scale.reshape((1,)).to(torch.float32))
    out = list(grads)
    work = []
    checks_only = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if i in skip:
            checks_only.append(g)
            continue
        if g.dtype != torch.float32:
            g = g.to(torch.float32)
            out[i] = g
        work.append(g)
    if work:
        torch._amp_foreach_non_finite_check_and_unscale_(work, found_inf, inv_scale)
    for g in checks_only:
        found_inf = torch.maximum(
            found_inf, torch.logical_not(torch.isfinite(g).all()).to(torch.float32)
        )
    return out, found_inf


def apply(step, grads, trainable_variables, unscaled_by_caller):
    import torch

    with torch.no_grad():
        if unscaled_by_caller:
            unscaled = grads
            finite = not step.config.checks_finite or bool(step.check_finite(grads))
        else:
            scale = step.variables[0].value
            if common.scale_of_grads(step, scale) is None:  # nothing to unscale: by 1
                scale = torch.ones_like(scale)
            unscaled, found_inf = unscale_and_check(grads, scale, skip=step.skip)
            # The one host read, as GradScaler's.
            finite = not step.config.checks_finite or not bool(found_inf)
        if finite:
            step.apply_inner(unscaled, trainable_variables)
        update_in_place(step, finite)
    return finite


def update_in_place(step, finite):
    """`loss_scale.update(state, finite, config)` as in-place torch ops.

    The same transition with a Python bool, written with raw torch ops:
    through `keras.ops` the dozen scalar ops of a step cost about as much as
    the gradient check itself on a small model. Nothing is read on the host.
    """
    import torch

    config = step.config
    scale, good_steps, skipped_steps = (v.value for v in step.variables)
    if not finite:
        skipped_steps.add_(1)
        good_steps.zero_()
        if config.dynamic:
            torch.maximum(scale * config.backoff_factor, _bound(scale, config.floor), out=scale)
        return
    good_steps.add_(1)
    if config.dynamic:
        grow = good_steps >= config.dynamic_growth_steps
        grown = torch.minimum(scale * config.growth_factor, _bound(scale, config.max_scale))
        scale.copy_(torch.where(grow, grown, scale))
        good_steps.masked_fill_(grow, 0)


_BOUNDS = {}


def _bound(scale, value):
    # A float32 tensor of min_scale / max_scale, as `ops.maximum` and
    # `ops.minimum` convert them in `update`; made once per device and value.
    key = (value, scale.device)
    if key not in _BOUNDS:
        import torch

        _BOUNDS[key] = torch.tensor(value, dtype=scale.dtype, device=scale.device)
    return _BOUNDS[key]


class Float32Grads:
    """O3's half gradients in float32, each taken as the backward pass
    accumulates it (`register_post_accumulate_grad_hook`), its half `.grad`
    let go there, as Apex's O2 drops the half gradients once the master
    gradients hold them.

    Otherwise a step holds every half gradient (autograd's `.grad`, listed
    by Keras's train step) beside its float32 copy for the master update:
    half again the float32 gradients' bytes at the optimizer's peak, which
    Keras's policy (float32 gradients only) does not pay. The values are the
    same: the half sum autograd accumulated, converted once (two backward
    passes in one step add in float32).

    Taken only while `collecting` (Keras's own train step, whose one reader
    of `.grad` is the list it hands to the optimizer, where `filled` puts
    them back); elsewhere `.grad` is as PyTorch leaves it. After `fit`'s
    step a half variable's `.grad` is empty (a callback reading it, or a
    post-accumulate-grad hook of the user's added after the optimizer was
    built, sees None): a model's own `train_step` keeps it.

    Args:
        variables: the half variables with float32 master copies.
    """

    def __init__(self, variables):
        self.taken = {}
        self.on = False
        take = functools.partial(_take, weakref.ref(self))
        hooks = [v.value.register_post_accumulate_grad_hook(take) for v in variables]
        # Gone with this object (a model compiled again, an optimizer built again).
        weakref.finalize(self, _remove_all, hooks)

    @contextlib.contextmanager
    def collecting(self):
        self.taken.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False
            self.taken.clear()

    def filled(self, grads, variables):
        """`grads` with each gradient taken in place of its `None`."""
        if not self.taken:
            return grads
        return [
            self.taken.pop(id(v.value), None) if g is None else g for g, v in zip(grads, variables)
        ]


def _remove_all(hooks):
    for hook in hooks:
        hook.remove()


def _take(owner, parameter):
    self = owner()
    if self is None or not self.on or parameter.grad is None:
        return
    grad = parameter.grad.float()
    earlier = self.taken.get(id(parameter))  # a second backward pass in the step
    self.taken[id(parameter)] = grad if earlier is None else earlier.add_(grad)
    parameter.grad = None


def log_value(variable):
    # A copy: PyTorch updates the variables in place at later steps.
    return variable.value.clone()


# -- the doctor and the device --------------------------------------------------


def float32_gradients(model, x, y, loss_fn, sample_weight):
    variables = model.trainable_variables
    for v in variables:
        v.value.grad = None
    loss = loss_fn(y, model(x, training=True), sample_weight)
    loss.backward()
    return [v.value.grad.detach() for v in variables]


def gpu_compute_capability():
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def gpu_name():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def computes_half_matmuls(dtype):
    import torch

    return dtype != "float16" or torch.cuda.is_available()


# -- layers and optimizers -----------------------------------------------------


def variables_changed(model):
    keras_internals.retrack_torch_parameters(model)


def step_each_variable(optimizer):
    # Keras's fused PyTorch step writes the tensors with `torch._foreach_*`:
    # step each variable through `update_step`.
    if not hasattr(type(optimizer), "_parallel_update_step"):
        return
    import torch

    def one_at_a_time(grads, variables, learning_rate):
        with torch.no_grad():
            for gradient, variable in zip(grads, variables):
                optimizer.update_step(gradient, variable, learning_rate)

    optimizer._backend_update_step = one_at_a_time


def train_step_memory(model, data):
    """`(held, saved)` of one train step (`train_on_batch`), after which
    every variable holds its value from before the step."""
    from keras_mp._src.backends import torch_dispatch

    return torch_dispatch.memory_of_one_step(model, data)


def train_step_largest(model, data):
    """The elements of the largest floating-point tensor one train step
    (`train_on_batch`) makes, after which every variable is as before."""
    from keras_mp._src.backends import torch_dispatch

    return torch_dispatch.largest_of_one_step(model, data)


def train_step_matmuls(model, data):
    """The matmuls PyTorch dispatches in one train step (`train_on_batch`),
    after which every variable of the model, its optimizer and metrics holds
    its value from before the step."""
    from keras_mp._src.backends import torch_dispatch

    return torch_dispatch.matmuls_of_one_step(model, data)


def saved_in_half(forward, backward, x, dtype):
    """`common.saved_in_half` as a `torch.autograd.Function` that saves only
    the half output (Keras's `custom_gradient` saves its inputs too)."""
    import torch

    if not (torch.is_grad_enabled() and x.requires_grad) or torch.jit.is_tracing():
        # Nothing kept for a backward pass (inference, an export's trace).
        return forward(x).to(getattr(torch, dtype))
    global _KeptInHalf
    if _KeptInHalf is None:

        class _KeptInHalf(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, forward, backward, dtype):
                y = forward(x).to(dtype)
                ctx.backward = backward
                ctx.input_dtype = x.dtype
                ctx.save_for_backward(y)
                return y

            @staticmethod
            def backward(ctx, upstream):
                (y,) = ctx.saved_tensors
                axis = getattr(ctx.backward, "axis", None)
                if axis is None or torch.is_grad_enabled():
                    # Recorded for a second derivative (`create_graph`, a
                    # gradient penalty): out-of-place, differentiable.
                    dx = ctx.backward(y.float(), upstream.float())
                else:
                    dx = _softmax_gradient(y, upstream, axis)
                return dx.to(ctx.input_dtype), None, None, None

    return _KeptInHalf.apply(x, forward, backward, getattr(torch, dtype))


_KeptInHalf = None


def _softmax_gradient(y, upstream, axis):
    """`probabilities`' softmax gradient `y * (g - sum(g * y))` in float32
    from the half `y` and `upstream`, the same roundings, with two float32
    tensors of their shape alive at once instead of four (a step's peak of
    live tensors when the probabilities are most of it)."""
    import torch

    y = y.float()
    work = upstream * y  # float32: half times float32
    total = work.sum(dim=axis, keepdim=True)
    torch.sub(upstream, total, out=work)
    return work.mul_(y)


def recomputed_from_half(function, inputs, weights):
    """`function(inputs, weights)` as one `torch.autograd.Function`: its
    forward records nothing and saves only the half `inputs`; its backward
    computes `function` again on them and differentiates it (`weights`: the
    values it reads, whose gradients it returns), differentiably again
    under `create_graph` (a gradient penalty)."""
    import torch

    if (
        not torch.is_grad_enabled()
        or torch.jit.is_tracing()
        or not any(t.requires_grad for t in (*inputs, *weights))
    ):
        return function(inputs, weights)
    global _Recomputed
    if _Recomputed is None:

        class _Recomputed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, function, count, *tensors):
                ctx.function, ctx.count = function, count
                ctx.weights = tensors[count:]
                ctx.save_for_backward(*tensors[:count])
                outputs = function(tensors[:count], tensors[count:])
                if not isinstance(outputs, torch.Tensor):
                    raise TypeError(f"a recomputed layer returned {type(outputs).__name__}")
                return outputs

            @staticmethod
            def backward(ctx, upstream):
                inputs = ctx.saved_tensors
                again = torch.is_grad_enabled()  # `create_graph`: differentiable
                if not again:
                    inputs = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
                wrt = [t for t in (*inputs, *ctx.weights) if t.requires_grad]
                # What the second forward saves is the backward's own (a
                # memory census of the step leaves it out).
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
                    outputs = ctx.function(inputs, ctx.weights)
                found = iter(
                    torch.autograd.grad(
                        outputs, wrt, upstream, allow_unused=True, create_graph=again
                    )
                )
                grads = [next(found) if t.requires_grad else None for t in (*inputs, *ctx.weights)]
                return (None, None, *grads)

    return _Recomputed.apply(function, len(inputs), *inputs, *weights)


def _kept(tensor):
    return tensor


_Recomputed = None


def rounded(x, dtype):
    """bfloat16: to nearest even on the bits (torch.compile's inductor drops
    a pair of casts, as XLA's GPU compiler does); NaN and infinities as they are."""
    import torch

    if keras.backend.standardize_dtype(dtype) != "bfloat16":
        return common.rounded(x, dtype)
    bits = x.float().view(torch.int32)  # int32 wraps as uint32 would
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return torch.where(torch.isfinite(x), up.view(torch.float32), x.float())
