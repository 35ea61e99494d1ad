"""A float32 normalisation of a half model keeps its half inputs for the
backward pass and computes again there (`precision/recomputed.py`, issue 65:
PyTorch's T5 saved 1.21x the bytes of Keras's mixed policy at O2)."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.tools import compiled_census
from tests.steps import BACKEND


class ScaleNorm(keras.layers.Layer):
    """A norm of the user's (KerasHub's `T5LayerNorm`, written out): O2's
    deny-list keeps it in float32 by its name."""

    def build(self, shape):
        self.weight = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return self.weight * (x * keras.ops.rsqrt(keras.ops.mean(x * x, -1, keepdims=True) + 1e-6))


class CountingNorm(ScaleNorm):
    """A norm whose forward updates state of its own: never computed twice."""

    def build(self, shape):
        super().build(shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x):
        self.calls.assign(self.calls + 1.0)
        return super().call(x)


class Block(keras.layers.Layer):
    """A composite half block (its own `call`), a norm inside."""

    def __init__(self, counting=False, **kwargs):
        super().__init__(**kwargs)
        self.counting = counting
        self.dense = keras.layers.Dense(32)
        self.norm = (CountingNorm if counting else ScaleNorm)(name="inner_norm")

    def get_config(self):
        return {**super().get_config(), "counting": self.counting}

    def call(self, x):
        return x + self.dense(self.norm(x))


def _model(counting=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12, 32))
    x = Block(counting, name="block")(keras.layers.Dense(32)(inputs))
    x = (CountingNorm if counting else ScaleNorm)(name="graph_norm")(x)  # the graph's own
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 12, 32)).astype("float32"), rng.normal(size=(64, 12, 4))


def test_a_half_model_s_norm_trains_as_float32_and_keeps_half_on_pytorch():
    x, y = _data()
    model = _model()
    reference = _model()
    reference.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    summary = keras_mp.precision_summary(model).text
    for name in ("inner_norm", "graph_norm"):
        assert any(name in line and "float32" in line for line in summary.splitlines())
    # The same numbers as the float32 norm it is, within bfloat16's tolerance
    # of the half layers around it.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(model(x[:8])), keras.ops.convert_to_numpy(reference(x[:8])),
        rtol=0.05, atol=0.05,
    )  # fmt: skip
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < history[0]
    if BACKEND != "torch":
        return
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras_model = _model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    keras_model.compile(optimizer="sgd", loss="mse")
    ours = compiled_census.memory(model, x[:16], y[:16])
    theirs = compiled_census.memory(keras_model, x[:16], y[:16])
    # The norms' float32 inputs (16 x 12 x 32, twice) are no longer kept.
    assert ours.saved.get("float32", 0) < 2 * 16 * 12 * 32 * 4, ours
    assert ours.saved_bytes <= 1.02 * theirs.saved_bytes, (ours, theirs)


def test_a_norm_with_state_of_its_own_is_computed_once_a_step():
    x, y = _data()
    model = _model(counting=True)
    model.compile(optimizer="sgd", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    model.train_on_batch(x[:16], y[:16])
    for name in ("block", "graph_norm"):
        layer = model.get_layer(name)
        norm = layer.norm if name == "block" else layer
        assert float(keras.ops.convert_to_numpy(norm.calls)) == 1.0


# O2's recomputed norms are saved each backend's way; O0 has none to save.
@pytest.mark.parametrize("level", ["O2", pytest.param("O0", marks=pytest.mark.one_backend)])
def test_a_model_with_recomputed_norms_saves_and_reloads(tmp_path, level):
    x, _ = _data()
    model = _model()
    model.compile(optimizer="sgd", loss="mse", amp_level=level, amp_dtype="bfloat16")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"ScaleNorm": ScaleNorm, "Block": Block})
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x[:4])), keras.ops.convert_to_numpy(model(x[:4]))
    )


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's autograd, by hand")
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-norms"])
def test_a_stateless_call_differentiates_the_values_it_was_given(frozen):
    """A custom loop's `stateless_call` (values of its own, not the
    variables'): the recomputed norms differentiate those values, as the
    plain call does; frozen norms (LoRA) are recomputed too."""
    import torch

    x, _ = _data()
    model = _model()
    model.compile(optimizer="sgd", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    for name in ("graph_norm",):
        model.get_layer(name).trainable = not frozen
    trainable = [v.value.detach().clone().requires_grad_(True) for v in model.trainable_variables]
    others = [v.value.detach().clone() for v in model.non_trainable_variables]
    inputs = torch.tensor(x[:8])
    out, _ = model.stateless_call(trainable, others, inputs, training=True)
    grads = torch.autograd.grad(out.float().square().sum(), trainable)
    # The same values as the variables: the plain call's gradients.
    out = model(inputs, training=True)
    expected = torch.autograd.grad(
        out.float().square().sum(), [v.value for v in model.trainable_variables]
    )
    for variable, g, e in zip(model.trainable_variables, grads, expected):
        assert g is not None and torch.equal(g, e), variable.path
