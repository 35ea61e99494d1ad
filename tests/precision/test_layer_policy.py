"""Setting a layer's policy (`layer_policy.py`): a built model's variables
recast in place (the same objects, on each backend's own variables), a
weight created with a dtype of its own keeping it, PyTorch's parameter
registry following the new variables."""

import keras
import numpy as np
import pytest

import keras_mp
from tests import models


def test_o3_converts_a_built_model_in_place():
    model = models.small_cnn()
    x = np.random.default_rng(1).normal(size=(4, 8, 8, 1)).astype("float32")
    reference = keras.ops.convert_to_numpy(model(x))
    variables = list(model.weights)
    values = [np.asarray(v) for v in variables]
    same = keras_mp.apply_amp(model, "O3", "float16")
    assert same is model
    assert all(a is b for a, b in zip(model.weights, variables))  # same objects
    for variable, value in zip(model.weights, values):
        if variable.path.startswith("cnn/probs"):
            continue
        assert variable.dtype == "float16", variable.path
        np.testing.assert_array_equal(np.asarray(variable), value.astype(np.float16))
    out = keras.ops.convert_to_numpy(model(x))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference, atol=2e-2)
    # And back to float32 variables.
    keras_mp.apply_amp(model, "O0")
    assert all(v.dtype == "float32" for v in model.weights)


class _Tempered(keras.layers.Layer):
    """A user's layer with a weight of a dtype of its own (a float32
    temperature, a tf.keras 2 habit for a delicate value) and a counter."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4))
        self.temperature = self.add_weight(shape=(), initializer="ones", dtype="float32")
        self.calls = self.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False)

    def call(self, x):
        return keras.ops.matmul(x, self.kernel) / self.temperature


# Recasting a built model's variables is each backend's own; the dtypes an
# unbuilt layer is built in are the policy's decision.
@pytest.mark.parametrize(
    "built", [pytest.param(False, marks=pytest.mark.one_backend), True], ids=["unbuilt", "built"]
)
def test_weights_created_with_their_own_dtype_keep_it(built):
    """A model built in bfloat16 (as KerasHub's `from_preset(..., dtype=...)`
    builds one) with a layer that created a float32 weight of its own, set
    to float16: its default weights become float16, the float32 and integer
    ones keep their dtypes, as building it under Keras's float16 policy
    gives, and as when it was not built yet."""
    keras.utils.set_random_seed(0)
    layer = _Tempered(dtype="bfloat16")
    head = keras.layers.Dense(2, dtype="bfloat16")
    model = keras.Sequential([keras.Input((3,)), layer, head] if built else [layer, head])
    keras_mp.apply_amp(model, "O3", "float16")
    model(np.ones((1, 3), "float32"))
    assert [v.dtype for v in layer.weights] == ["float16", "float32", "int32"]
    reference = _Tempered(dtype="float16")
    reference.build((1, 3))
    assert [v.dtype for v in reference.weights] == [v.dtype for v in layer.weights]


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's parameter registry")
def test_o3_registers_the_converted_weights_with_pytorch():
    """O3 gives a built layer new (half) torch parameters. A Sequential keeps
    its parameters in a module of its own too; left stale there,
    `model.zero_grad()` (Keras's PyTorch step, the guides' GAN) cleared the
    old ones, and the new ones' gradients added up from step to step."""
    model = models.small_cnn()
    keras_mp.apply_amp(model, "O3", "bfloat16")
    parameters = {id(p) for p in model.parameters()}
    assert all(id(v.value) in parameters for v in model.trainable_weights)
    assert len(parameters) == len(model.weights)
