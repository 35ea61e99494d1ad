"""Configs of your own blocks that rebuild in the precision keras_mp set
(`loadable_config.py`).

What a config says is decided before any backend computes: these are proven
once (`one_backend`); each backend's own saving and loading is in
`tests/test_saving.py`, `tests/model/test_saved_precision.py` and
`tests/model/test_config_precision.py`."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.saving import block_at_o3
from tests.saving import data
from tests.saving import fit
from tests.saving import with_block


@pytest.mark.one_backend
def test_a_block_of_your_own_in_half_loads_without_its_compile(tmp_path):
    """`keras_mp.serving_copy` rebuilds the model from its config alone: a
    block of your own that computes in half comes back in Keras's default
    policy with the layers it makes, so that it can be rebuilt at all, and
    its outputs are the model's within half precision. `load_model` gives
    the saved precision back, `compile=False` too (issue 63.10): the block
    computes in half again, as saved, bit for bit."""
    model = with_block()
    block_at_o3(model)
    fit(model, epochs=1)
    assert model.get_layer("block").dtype_policy.name == "float16"
    path = str(tmp_path / "model.keras")
    model.save(path)
    x, _ = data()
    x = np.nan_to_num(x)
    expected = model.predict(x, verbose=0)
    copy = keras_mp.serving_copy(model, "float32")
    assert copy.get_layer("block").dtype_policy.name == "float32"
    np.testing.assert_allclose(copy.predict(x, verbose=0), expected, atol=2e-2)
    loaded = keras.models.load_model(path, compile=False)
    assert loaded.get_layer("block").dtype_policy.name == "float16"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    # The live block's config still says what it computes in.
    assert model.get_layer("block").dtype_policy.name == "float16"


@pytest.mark.one_backend
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


# -- a model its constructor builds: the graph it was built with ---------------------


def _gemma(hidden_dim, head_dim):
    """The issue's tiny KerasHub GemmaCausalLM (hidden_dim=32: sqrt(32) is
    not a float16 number), or the zoo's (hidden_dim=16: sqrt(16) is)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=hidden_dim,
        intermediate_dim=64,
        head_dim=head_dim,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _predict(model, x):
    return np.asarray(keras.ops.convert_to_numpy(model.predict(x, verbose=0)), "float32")


# float16: the dtype whose constant was wrong (sqrt(32) is not a float16 number).
@pytest.mark.one_backend
def test_a_keras_hub_gemma_reloads_exactly_trained_or_not(tmp_path):
    """GemmaBackbone scales its embeddings by `ops.cast(sqrt(hidden_dim),
    x.dtype)`, a constant of its graph in the dtype it was built in. Rebuilt
    from a config whose dtype was the level's, the constant was float16's
    5.65625 instead of 5.656854: `predict` of the loaded model was 4e-3
    away (7e-3 after an epoch), weights and policies identical. Now it
    rebuilds the graph it was built with, and a model saved before
    training loads without Keras's "Skipping variable loading" warnings.
    (The zoo's Gemma, hidden_dim=16, goes through `.keras` in
    `tests/zoo/test_levels.py`: sqrt(16) is a float16 number.)"""
    import warnings

    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 64, (4, 8)).astype("int32"),
        "padding_mask": np.ones((4, 8), "int32"),
    }
    y = rng.integers(0, 64, (4, 8)).astype("int32")
    model = _gemma(hidden_dim=32, head_dim=16)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        amp_level="O2",
        amp_dtype="float16",
    )
    for trained in (False, True):
        if trained:
            model.fit(x, y, epochs=1, batch_size=4, verbose=0)
        path = str(tmp_path / f"gemma_{trained}.keras")
        model.save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(path)
        skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
        assert skipped == [], skipped
        np.testing.assert_array_equal(_predict(loaded, x), _predict(model, x))
        scale = keras.ops.convert_to_numpy(loaded.optimizer.loss_scale)
        assert float(scale) == float(keras.ops.convert_to_numpy(model.optimizer.loss_scale))


_PLAIN_KERAS_LOAD = """
import sys
import keras
import numpy as np
assert "keras_mp" not in sys.modules
x = np.load(sys.argv[1])
for path in sys.argv[2:]:
    try:
        model = keras.models.load_model(path, compile=False)
    except Exception as error:
        print("refused:", str(error).splitlines()[-1])
    else:
        print("loaded:", np.asarray(model.predict(x, verbose=0)).dtype)
"""


@pytest.mark.one_backend
def test_a_file_loaded_without_keras_mp_is_refused_by_name_and_with_it_exact(tmp_path):
    """Issue 63.10, at O2 float16 and O3 bfloat16: the head computes in half
    and returns float32 and its softmax runs in float32, which keras_mp does
    when the layer runs. A process that never imports keras_mp refuses the
    file with a message naming keras_mp, rather than predicting something
    else; one that has, loading with `compile=False` (no compile config
    read), predicts as the saved model did, bit for bit."""
    import subprocess
    import sys

    from tests import processes

    data = np.random.default_rng(0).normal(size=(4, 4)).astype("float32") * 30
    x_path = str(tmp_path / "x.npy")
    np.save(x_path, data)
    saved = {}
    for level, dtype in (("O2", "float16"), ("O3", "bfloat16")):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        x = keras.layers.Dense(8, activation="relu")(inputs)
        head = keras.layers.Dense(3, activation="softmax", name="head")(x)
        model = keras.Model(inputs, head)
        model.compile(
            optimizer="sgd",
            loss="sparse_categorical_crossentropy",
            amp_level=level,
            amp_dtype=dtype,
        )
        path = str(tmp_path / f"{level}.keras")
        model.save(path)
        saved[path] = model.predict(data, verbose=0)
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_KERAS_LOAD, x_path, *saved],
        env=processes.env_for(keras.backend.backend()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(
        ln.startswith("refused:") and "keras_mp" in ln for ln in lines
    ), result.stdout
    for path, predicted in saved.items():
        loaded = keras.models.load_model(path, compile=False)
        np.testing.assert_array_equal(loaded.predict(data, verbose=0), predicted)
