"""PyTorch (`backends/torch.py`): one flag read per step, as GradScaler."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.steps import BACKEND
from tests.steps import SCALED_BY_HAND
from tests.steps import tensor

pytestmark = SCALED_BY_HAND


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "torch", reason="counts PyTorch host reads")
def test_torch_apply_reads_one_flag_per_step(monkeypatch):
    """At most one host synchronisation per step, as torch.amp.GradScaler."""
    import torch

    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(0.1), dynamic_growth_steps=2)
    variables = [
        keras.Variable(np.ones((3, 3), np.float32)),
        keras.Variable(np.ones(3, np.float32)),
    ]
    optimizer.build(variables)
    reads = []
    for name in ("__bool__", "item", "tolist", "numpy", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for bad in (False, True, False, False):
        grads = [tensor(np.full((3, 3), np.inf if bad else 1.0)), tensor(np.ones(3))]
        reads.clear()
        optimizer.apply(grads, variables)
        assert len(reads) <= 1, reads


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd.Function")
def test_recomputed_from_half_keeps_the_half_inputs_and_the_gradients_to_the_bit():
    """`recomputed_from_half` (a float32 norm of a half model): the backward
    pass gets the gradients plain autograd gets, to the bit, second-order
    ones too (a gradient penalty), and the only tensors saved for it are the
    half inputs (a float32 copy was)."""
    import torch

    from keras_mp._src import backends

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.rand(16) + 0.5)
    half = (torch.randn(4, 8, 16) * 3).to(torch.bfloat16).requires_grad_(True)

    def norm(inputs, weights):  # T5's `T5LayerNorm`, in float32
        x = inputs[0].float()
        return weights[0] * (x * torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + 1e-6))

    upstream = torch.randn(4, 8, 16)
    expected = torch.autograd.grad(norm([half], [weight]), (half, weight), upstream)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = backends.current.recomputed_from_half(norm, [half], [weight])
    assert saved == [(torch.bfloat16, (4, 8, 16))]
    assert torch.equal(out, norm([half], [weight]))
    got = torch.autograd.grad(out, (half, weight), upstream)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.equal(g, e)

    def penalty(function):  # the input gradient's norm, differentiated again
        (g,) = torch.autograd.grad(function([half], [weight]).sum(), half, create_graph=True)
        return torch.autograd.grad(g.float().square().sum(), weight)[0]

    plain = penalty(norm)
    again = penalty(lambda i, w: backends.current.recomputed_from_half(norm, i, w))
    assert torch.equal(again, plain)
    with torch.no_grad():  # nothing to keep: the plain call
        assert torch.equal(backends.current.recomputed_from_half(norm, [half], [weight]), out)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd.Function")
def test_a_kept_softmax_differentiates_twice_with_the_same_first_gradient():
    """A softmax kept in half (a hand-off to its half consumer at O2): its
    backward pass is in place in a plain step, out of place where autograd
    records it for a second derivative (a gradient penalty, WGAN-GP's): the
    same first gradient to the bit either way, and the penalty's gradient
    reaches the weights before it."""
    import torch

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="pre")(inputs)
    x = keras.layers.Dense(2)(keras.layers.Softmax(name="softmax")(x))
    model = keras.Model(inputs, x)
    keras_mp.apply_amp(model, "O2", "bfloat16")
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert "kept in bfloat16" in rules["softmax"], rules
    x = torch.tensor(np.random.default_rng(0).normal(size=(2, 4)).astype("float32"))

    def input_gradient(create_graph):
        inputs = x.clone().requires_grad_(True)
        out = model(inputs, training=True)
        return torch.autograd.grad(out.sum(), inputs, create_graph=create_graph)[0]

    plain = input_gradient(False)
    recorded = input_gradient(True)
    assert torch.equal(plain, recorded.detach())
    kernel = model.get_layer("pre").kernel.value
    (penalty,) = torch.autograd.grad(recorded.square().sum(), kernel)
    assert torch.isfinite(penalty).all() and penalty.abs().sum() > 0


class _OwnStep(keras.Sequential):
    """A model with a `train_step` of its own (Keras's, through `super()`)."""

    def train_step(self, data):
        return super().train_step(data)


def _o3_model(cls, dtype):
    keras.utils.set_random_seed(3)
    model = cls(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer="adam", loss="mse", amp_level="O3", amp_dtype=dtype)
    return model


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's post-accumulate-grad hooks")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_o3_takes_half_gradients_in_float32_with_the_same_updates(dtype):
    """At O3, Keras's own train step hands the master update float32
    gradients taken as the backward pass makes them (`.grad` let go: the
    step holds no half gradients beside them); a model's own `train_step`
    sees `.grad` as PyTorch leaves it. The weights are the same to the bit."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    taken, own = _o3_model(keras.Sequential, dtype), _o3_model(_OwnStep, dtype)
    for _ in range(3):
        taken.train_on_batch(x, y)
        own.train_on_batch(x, y)
    for a, b in zip(
        taken.variables + taken.optimizer.variables, own.variables + own.optimizer.variables
    ):
        np.testing.assert_array_equal(
            np.asarray(a.numpy(), "float32"), np.asarray(b.numpy(), "float32"), err_msg=a.path
        )
    kernel = taken.layers[0].kernel
    assert keras.backend.standardize_dtype(kernel.dtype) == dtype
    assert kernel.value.grad is None
    assert own.layers[0].kernel.value.grad.dtype == kernel.value.dtype
    assert int(taken.optimizer.skipped_steps.numpy()) == int(own.optimizer.skipped_steps.numpy())
