"""The boundary rule: the dtype a layer returns to its caller, and a model's
float32 inputs and outputs."""

import keras
import numpy as np
import pytest

import keras_mp


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_subclassed_model_inputs_and_outputs_are_float32(level):
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(4)
            self.logits = keras.layers.Dense(2)

        def call(self, x):
            return {"logits": self.logits(self.hidden(x)), "hidden": self.hidden(x)}

    model = Net()
    keras_mp.apply_amp(model, level)
    keras_mp.apply_amp(model, level)  # idempotent: one cast, not two
    assert model.logits.compute_dtype == "float16"
    assert model.dtype_policy.name == "float32" and model.input_dtype == "float32"
    outputs = model(np.ones((2, 3), "float32"))
    assert {k: keras.backend.standardize_dtype(v.dtype) for k, v in outputs.items()} == {
        "logits": "float32",
        "hidden": "float32",
    }
    rule = keras_mp.precision_summary(model).rows[0]["rule"]
    assert rule == f"{level}: model, float32 inputs and outputs"


def test_boundary_rule_gives_the_caller_one_dtype():
    """A composite layer adding its sublayers' outputs: float32 LayerNorm in
    a float16 block (O2), float16 Dense in a float32 block (O1)."""

    @keras.saving.register_keras_serializable(package="keras_mp_tests")
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(8)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return x + self.norm(x) + self.dense(x)  # raw arithmetic on both

    model = keras.Sequential([keras.Input((8,)), Block(name="block"), keras.layers.Dense(2)])
    for level, block_dtype in [("O1", "float32"), ("O2", "float32"), ("O3", "float16")]:
        keras_mp.apply_amp(model, level, allow=[] if level != "O2" else None)
        block = model.get_layer("block")
        assert block.compute_dtype == block_dtype, level
        out = block(np.ones((2, 8), "float32"))
        assert keras.backend.standardize_dtype(out.dtype) == block_dtype
    # Opted into half at O2: LayerNorm (float32) returns float16 to it.
    keras_mp.apply_amp(model, "O2", allow=[Block])
    assert block.compute_dtype == "float16" and block.norm.compute_dtype == "float32"
    out = block(np.ones((2, 8), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    rows = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert any("returns float16 to block" in rule for rule in rows.values())
