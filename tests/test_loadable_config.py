"""Configs of your own blocks that rebuild in the precision keras_mp set
(`loadable_config.py`)."""

import keras
import numpy as np

import keras_mp
from tests.saving import block_at_o3
from tests.saving import data
from tests.saving import fit
from tests.saving import with_block


def test_a_block_of_your_own_in_half_loads_without_its_compile(tmp_path):
    """`load_model(compile=False)` and `keras_mp.serving_copy` rebuild the
    model from its config alone: a block of your own that computes in half
    comes back in Keras's default policy with the layers it makes, so that
    it can be rebuilt at all, and its outputs are the model's within half
    precision. `load_model` with its compile restores the half policies."""
    model = with_block()
    block_at_o3(model)
    fit(model, epochs=1)
    assert model.get_layer("block").dtype_policy.name == "float16"
    path = str(tmp_path / "model.keras")
    model.save(path)
    x, _ = data()
    x = np.nan_to_num(x)
    expected = model.predict(x, verbose=0)
    for copy in (
        keras.models.load_model(path, compile=False),
        keras_mp.serving_copy(model, "float32"),
    ):
        block = copy.get_layer("block")
        assert block.dtype_policy.name == "float32"
        np.testing.assert_allclose(copy.predict(x, verbose=0), expected, atol=2e-2)
    # The live block's config still says what it computes in.
    assert model.get_layer("block").dtype_policy.name == "float16"


def test_only_a_block_of_your_own_in_half_gives_no_dtype_in_its_config():
    model = with_block()
    block_at_o3(model)
    block = model.get_layer("block")
    assert block.dtype_policy.name == "float16"
    assert block.get_config()["dtype"] is None  # rebuilt with its sublayers
    assert block.get_config()["units"] == 16  # the rest of its config kept
    dense = model.get_layer("hidden")  # Keras's: passes its dtype on
    assert keras.dtype_policies.get(dense.get_config()["dtype"]).name == "float16"
    keras_mp.to_float(block, "float32")  # back in the default policy
    assert block.get_config()["dtype"] is not None
