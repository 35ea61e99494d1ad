"""The model zoo: real model families at every level, compared with float32.

Each family (KerasHub backbones and tasks, keras.applications CNNs, a masked
LSTM/GRU, a two-output model, a user's masked attention block) is built once
per process in a tiny configuration with random weights (`families.py`).

Which backend proves what (CI's time):

- What each layer computes in at each level is the rules' decision, the same
  Keras code on every backend (but for attention on JAX's CPU,
  `test_keras_hub.py`): `test_each_level_decides_what_a_family_computes_in`
  applies every level in both half dtypes to every family on TensorFlow,
  whose eager calls cost least here, without training: the summary's
  dtypes, the variables', and the outputs against float32's within the
  half dtype's tolerance.
- That a level trains as float32 does is each backend's own step (its loss
  scaling and skip, master weights; a graph on TensorFlow, XLA on JAX):
  `test_family_trains_step_by_step_as_float32_does` trains a family a few
  steps on the whole batch and compares each step's loss with float32's.
  Each family trains on PyTorch and, but ConvNeXt, compiled on TensorFlow
  or JAX, at another level (`TRAINED`); each backend trains at every level
  in both dtypes. What each backend compiles is read by
  `tests/tools/test_compiled_census.py` (lowered or traced, nothing trained).
"""

import keras
import numpy as np
import pytest

import keras_mp
from tests.zoo import families
from tests.zoo import runs
from tests.zoo.runs import BACKEND
from tests.zoo.runs import HALF
from tests.zoo.runs import JAX
from tests.zoo.runs import LEVELS
from tests.zoo.runs import np64

pytestmark = pytest.mark.zoo

# Relative tolerance of the outputs at a level against float32, before any
# training: about 2**-8 (float16) and 2**-5 (bfloat16) per value, grown over
# a few layers; O3 also rounds the weights.
TOLERANCE = {
    ("O1", "float16"): 0.02,
    ("O2", "float16"): 0.02,
    ("O3", "float16"): 0.05,
    ("O1", "bfloat16"): 0.1,
    ("O2", "bfloat16"): 0.1,
    ("O3", "bfloat16"): 0.25,
}
# An output's error against float32's, over how much float32's outputs vary
# from input to input (measured at most 0.055 in float16 and 0.48 in
# bfloat16, T5's at O3; an output that ignores its input scores about 1).
SPREAD = {"float16": 0.25, "bfloat16": 0.75}
# Mixture-of-experts models: their outputs are compared token by token.
ROUTED = {"mixtral"}
# O3 is half everywhere, the attention's own arithmetic too: their -1e9
# masks are NaN in float16 there, as under Keras's own float16 policy
# (bfloat16 has float32's range).
NAN_AT_O3_FLOAT16 = {"t5", "tutorial_attention"}

# Where each family trains: compiled (TensorFlow's graph, JAX's XLA) and on
# PyTorch (its steps op by op, a second or two), at a level not trained
# elsewhere. TensorFlow traces a family's step in 2-15 s on a CPU: it trains
# ten families. XLA compiles a step in 5-20 s (its float32 reference's
# too), a CNN's or an RNN's scan in 30-80 s: JAX trains four, the cheapest
# to compile of each kind (a causal LM, an encoder-decoder, a user's layer,
# two outputs with BatchNorm; its RNN step is compiled, untrained, by
# `test_compiled_census.py`). Each backend trains at every level in both
# dtypes.
# ConvNeXt trains on PyTorch only: its float32 steps alone take 7 s on
# TensorFlow (eagerly), its compiled ones 13 s, and its layers are the other
# CNNs' but for LayerNorm and layer scale, whose decisions
# `test_each_level_decides_what_a_family_computes_in` checks. Mixtral's
# load-balancing loss compiles on TensorFlow, where Keras's own policies
# fail on it; the user's masked attention trains on PyTorch at O2 in
# float16, where the rule keeps its arithmetic in float32.
TRAINED = {
    "bert": {"tensorflow": ("O1", "float16"), "torch": ("O2", "bfloat16")},
    "gpt2": {"jax": ("O2", "float16"), "torch": ("O3", "bfloat16")},
    "gemma": {"tensorflow": ("O3", "bfloat16"), "torch": ("O1", "float16")},
    "t5": {"jax": ("O1", "bfloat16"), "torch": ("O2", "float16")},
    "transformer_encoder": {"tensorflow": ("O2", "bfloat16"), "torch": ("O3", "float16")},
    "resnet": {"tensorflow": ("O3", "bfloat16"), "torch": ("O1", "float16")},
    "mixtral": {"tensorflow": ("O2", "float16"), "torch": ("O3", "bfloat16")},
    "resnet50": {"tensorflow": ("O1", "float16"), "torch": ("O2", "bfloat16")},
    "mobilenet_v2": {"tensorflow": ("O3", "float16"), "torch": ("O1", "bfloat16")},
    "efficientnet": {"tensorflow": ("O2", "float16"), "torch": ("O3", "bfloat16")},
    "convnext": {"torch": ("O2", "bfloat16")},
    "lstm_masked": {"tensorflow": ("O3", "bfloat16"), "torch": ("O2", "float16")},
    "tutorial_attention": {
        "tensorflow": ("O3", "bfloat16"),
        "jax": ("O1", "float16"),
        "torch": ("O2", "float16"),
    },
    "two_outputs": {"jax": ("O3", "float16"), "torch": ("O1", "bfloat16")},
}
assert set(TRAINED) == set(families.FAMILIES)
for _backend in ("tensorflow", "jax", "torch"):
    _cells = {cells[_backend] for cells in TRAINED.values() if _backend in cells}
    assert {level for level, _ in _cells} == set(LEVELS), _backend
    assert {half for _, half in _cells} == set(HALF), _backend


def _decided_cells(family):
    for level in LEVELS:
        for half in HALF:
            if not (level == "O3" and half == "float16" and family in NAN_AT_O3_FLOAT16):
                yield level, half


# TensorFlow's eager calls: PyTorch's float16 depthwise convolutions take
# 1.5 s each on a CPU (the three CNNs that have them: 45 s against 6 s).
@pytest.mark.one_backend("tensorflow")
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=[pytest.mark.heavy] if f in families.APPLICATIONS else [])
        for f in families.FAMILIES
    ],
)
def test_each_level_decides_what_a_family_computes_in(family):
    """At each level in each half dtype, before any training: the outputs are
    float32, the float32 model's within the half dtype's tolerance, and they
    vary from input to input as the float32 model's do (`SPREAD`: an output
    that ignores its input, a constant 1/3, is as far from them as they are
    from their mean); normalizations and softmax compute in float32 and the
    variables are float32 at O1 and O2; O3's variables are half."""
    model, x, y, loss = runs.model(family)
    weights = model.get_weights()
    reference = [np64(o) for o in runs.outputs(model, x)]
    for level, half in _decided_cells(family):
        keep = runs.keep_batchnorm(model, level)
        keras_mp.apply_amp(model, level, half, keep_batchnorm_fp32=keep)
        model.set_weights(weights)  # O3: the float32 weights rounded once
        cell = (family, level, half)
        tolerance = TOLERANCE[(level, half)]
        for out, ref in zip(runs.outputs(model, x), reference):
            assert keras.backend.standardize_dtype(out.dtype) == "float32", cell
            error = np.abs(np64(out) - ref)
            bound = tolerance * (1.0 + np.max(np.abs(ref)))
            if family in ROUTED:
                # Top-k routing: where two experts' logits nearly tie, rounding
                # upstream picks the other expert for that token.
                rerouted = np.mean(error.max(axis=-1) > bound)
                assert rerouted <= 0.05, (cell, rerouted)
                continue
            assert np.max(error) <= bound, (cell, np.max(error))
            spread = np.linalg.norm(ref - ref.mean(axis=0))
            if spread > 1e-6 * np.linalg.norm(ref):  # (a CNN at init may give one output)
                ratio = np.linalg.norm(np64(out) - ref) / spread
                assert ratio <= SPREAD[half], (cell, ratio)
        for row in keras_mp.precision_summary(model).rows:
            if level in ("O1", "O2") and row["class"].endswith(("Norm", "Normalization")):
                assert row["compute_dtype"] == "float32", (cell, row)
            if level in ("O1", "O2") and row["class"] == "Softmax":
                assert row["compute_dtype"] == "float32", (cell, row)
        dtypes = {v.dtype for v in model.trainable_variables}
        assert dtypes == {"float32"} if level != "O3" else half in dtypes, (cell, dtypes)


def _assert_round_trip(model, x, path):
    """Saved and loaded: the same outputs bit for bit (on JAX, whose
    `predict` compiles again for the loaded model, the same weights), the
    same precision per layer, the same optimizer state (KerasHub's tasks
    too, whose `compile` Keras skips at load, and whose constructor makes
    an optimizer)."""
    before = None if JAX else [np64(o) for o in runs.outputs(model, x)]
    model.save(path)
    loaded = keras.models.load_model(path)
    if JAX:
        for got, want in zip(loaded.weights, model.weights):
            np.testing.assert_array_equal(np64(got), np64(want), err_msg=want.path)
    else:
        for a, b in zip(runs.outputs(loaded, x), before):
            np.testing.assert_array_equal(np64(a), b)
    assert [v.dtype for v in loaded.weights] == [v.dtype for v in model.weights]
    assert [r["compute_dtype"] for r in keras_mp.precision_summary(loaded).rows] == [
        r["compute_dtype"] for r in keras_mp.precision_summary(model).rows
    ]
    assert loaded.get_compile_config()["amp_level"] == model.get_compile_config()["amp_level"]
    assert type(loaded.optimizer) is type(model.optimizer)
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np64(got), np64(want), err_msg=want.path)


def _trained_cells():
    for family, by_backend in TRAINED.items():
        if BACKEND in by_backend:
            level, half = by_backend[BACKEND]
            marks = [pytest.mark.heavy] if family in families.APPLICATIONS else []
            yield pytest.param(family, level, half, marks=marks, id=f"{family}-{level}-{half}")


@pytest.mark.slow(
    reason="compiles a real family's train step and its float32 reference: 30-80 s for "
    "a causal LM or a CNN on TensorFlow and JAX"
)
@pytest.mark.parametrize("family, level, half", list(_trained_cells()))
def test_family_trains_step_by_step_as_float32_does(family, level, half, tmp_path):
    """Each step's loss is float32's after as many applied steps (a skipped
    step applies nothing), within half of float32's smallest step; the
    variables are in the level's dtypes; and a `.keras` file gives the
    trained model back as it was."""
    model, x, _ = runs.trains_as_float32_does(family, level, half)
    dtypes = {v.dtype for v in model.trainable_variables}
    assert dtypes == {"float32"} if level != "O3" else half in dtypes, dtypes
    _assert_round_trip(model, x, tmp_path / f"{family}.keras")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="SavedModel export is TensorFlow's")
@pytest.mark.parametrize("family", ["bert", "resnet", "lstm_masked"])
def test_family_exports_a_float32_signature(family, tmp_path):
    """A transformer's dict of inputs, a CNN's BatchNorm, an RNN's mask: the
    serving signature takes and returns float32, and serves the model's
    outputs (the export traces the serving function, not the train step)."""
    import tensorflow as tf

    model, x, y, loss = runs.model(family)
    runs.compile_at(model, loss, "O2", "float16", family)
    expected = np64(model(x, training=False))
    path = str(tmp_path / family)
    model.export(path)
    signature = tf.saved_model.load(path).signatures["serving_default"]
    inputs = signature.structured_input_signature[1]
    assert {spec.dtype for spec in inputs.values() if spec.dtype.is_floating} <= {tf.float32}
    feed = x if isinstance(x, dict) else {next(iter(inputs)): x}
    feed = {name: tf.constant(feed[name], dtype=spec.dtype) for name, spec in inputs.items()}
    (served,) = signature(**feed).values()
    assert served.dtype == tf.float32
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-3, atol=1e-3)
