"""SavedModel export of mixed-precision models, and serving in another dtype.

The serving signature takes and returns float32 at every level; the reloaded
artifact (`tf.saved_model.load`, `keras.layers.TFSMLayer`) computes what the
in-memory model computes. `keras_mp.export(model, path, dtype=...)` serves a
copy in another precision without touching the model being trained.

TensorFlow and JAX export SavedModels (JAX through jax2tf); Keras cannot on
the PyTorch backend without torch_xla, and keras_mp.export says so.
"""

import gc
import logging
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_mp

BACKEND = keras.backend.backend()
needs_saved_model = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras exports SavedModels from TensorFlow and JAX"
)
# float16 carries 11 significant bits; these tiny models compound few roundings.
HALF_TOLERANCE = dict(rtol=1e-2, atol=1e-3)
# bfloat16 carries 8: the served graph (no XLA) and `predict` (XLA where Keras
# compiles it, as on a GPU) round a logit of about 1 differently by 2**-8.
BFLOAT16_TOLERANCE = dict(rtol=5e-2, atol=2e-2)


def _tolerance(dtype):
    return BFLOAT16_TOLERANCE if dtype == "bfloat16" else HALF_TOLERANCE


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")
    return x, y


def _functional():
    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    return keras.Model(inputs, outputs)


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.bn = keras.layers.BatchNormalization()
        self.logits = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.logits(self.bn(self.hidden(x), training=training))


def _trained(level, dtype, kind):
    keras.utils.set_random_seed(0)
    model = _functional() if kind == "functional" else Subclassed()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=kind != "functional")
    model.compile(optimizer="adam", loss=loss, amp_level=level, amp_dtype=dtype)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # BatchNorm's statistics move
    return model


# Two models, trained once for the module: between them the cells whose
# export differs. float16 with float32 variables (O2: the copy's float32
# weights could be the model's own arrays) in a functional model; bfloat16
# with half variables (O3: the copy casts them) in a subclassed one. Both
# carry a LossScaleOptimizer. Tests that train them further compare with
# what the model computes then.
@pytest.fixture(scope="module")
def float16_model():
    return _trained("O2", "float16", "functional")


@pytest.fixture(scope="module")
def bfloat16_model():
    return _trained("O3", "bfloat16", "subclassed")


def _layer(model, name):
    return getattr(model, name) if isinstance(model, Subclassed) else model.get_layer(name)


def _tf():
    import tensorflow as tf

    return tf


def _load(path):
    tf = _tf()
    loaded = tf.saved_model.load(path)
    return loaded, loaded.signatures["serving_default"]


def _assert_float32_signature(signature):
    specs = list(signature.structured_input_signature[1].values())
    assert [s.dtype.name for s in specs] == ["float32"]
    outputs = list(signature.structured_outputs.values())
    assert [s.dtype.name for s in outputs] == ["float32"]


def _serve(signature, x):
    tf = _tf()
    (name,) = signature.structured_input_signature[1]
    (out,) = signature(**{name: tf.constant(x)}).values()
    assert out.dtype.name == "float32"
    return out.numpy()


def _graph_dtypes(signature):
    """The dtypes the served TensorFlow graph's ops compute in, inside the
    functions it calls too (a signature's own graph is one call)."""
    tf = _tf()
    graph = signature.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return {
        tf.dtypes.as_dtype(t).name
        for n in nodes
        for a in n.attr.values()
        for t in ([a.type] if a.HasField("type") else list(a.list.type))
    }


def _assets_written(caplog):
    return [r for r in caplog.records if "Assets written" in r.getMessage()]


@needs_saved_model
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_model_export_serves_float32(tmp_path, caplog, request, dtype):
    """`model.export(path)` as trained: the half graph inside (SavedModels
    run float16 and bfloat16), float32 in and out, computing what `predict`
    does; TensorFlow's INFO lines shown (as a notebook shows them) unless
    `verbose=False` (`test_keras_mp_export_float32_for_cpu_serving`)."""
    model = request.getfixturevalue(f"{dtype}_model")
    x, _ = _data()
    expected = model.predict(x, verbose=0)
    assert expected.dtype == np.float32
    path = str(tmp_path / "exported")
    caplog.set_level(logging.INFO, logger="tensorflow")
    model.export(path)
    assert _assets_written(caplog)

    loaded, signature = _load(path)
    assert sorted(loaded.signatures) == ["serve", "serving_default"]
    _assert_float32_signature(signature)
    if BACKEND == "tensorflow":
        assert dtype in _graph_dtypes(signature)  # as trained, not a float32 copy
    elif dtype == "bfloat16":  # jax2tf's graph is one XLA call: its half variables
        assert dtype in {v.dtype.name for v in loaded.variables}
    tolerance = _tolerance(dtype)
    np.testing.assert_allclose(_serve(signature, x), expected, **tolerance)
    np.testing.assert_allclose(loaded.serve(_tf().constant(x)).numpy(), expected, **tolerance)
    if BACKEND == "tensorflow":
        layer = keras.layers.TFSMLayer(path, call_endpoint="serve")
        np.testing.assert_allclose(_numpy(layer(x)), expected, **tolerance)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.saved_model.save takes TensorFlow objects")
def test_tf_saved_model_save(tmp_path, bfloat16_model):
    """TensorFlow's own `tf.saved_model.save` of a model with half
    variables, a LossScaleOptimizer and master weights (subclassed: its
    signature traced from its call)."""
    model = bfloat16_model
    tf = _tf()
    x, _ = _data()
    path = str(tmp_path / "saved")
    tf.saved_model.save(model, path)
    loaded, signature = _load(path)
    assert sorted(loaded.signatures) == ["serving_default"]
    _assert_float32_signature(signature)
    expected = model.predict(x, verbose=0)
    np.testing.assert_allclose(_serve(signature, x), expected, **_tolerance("bfloat16"))


def _policies(model):
    return [
        (layer.name, layer.dtype_policy.name)
        for layer in model._flatten_layers(include_self=True, recursive=True)
    ]


def _reference_forward(model, x):
    """The model's forward pass in float64 NumPy, from its weights."""
    w = [_numpy(v).astype("float64") for v in model.weights]
    kernel1, bias1, gamma, beta, mean, var, kernel2, bias2 = w
    bn = _layer(model, "bn")
    h = np.maximum(x.astype("float64") @ kernel1 + bias1, 0)
    h = (h - mean) / np.sqrt(var + bn.epsilon) * gamma + beta
    logits = h @ kernel2 + bias2
    if isinstance(model, Subclassed):
        return logits
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@needs_saved_model
def test_keras_mp_export_float32_for_cpu_serving(tmp_path, caplog, bfloat16_model):
    """A model computing in half everywhere (O3) served from a float32 copy:
    float32 variables, not one half tensor in the served graph, the float64
    forward pass of its weights to float32's rounding; the model untouched,
    and `verbose=False` quiet where TensorFlow logs at INFO."""
    model = bfloat16_model
    weights = [w.copy() for w in model.get_weights()]
    path = str(tmp_path / "served")
    caplog.set_level(logging.INFO, logger="tensorflow")
    keras_mp.export(model, path, dtype="float32", verbose=False)
    assert not _assets_written(caplog)
    assert logging.getLogger("tensorflow").level == logging.INFO  # restored

    loaded, signature = _load(path)
    assert sorted(loaded.signatures) == ["serve", "serving_default"]
    _assert_float32_signature(signature)
    # The artifact holds float32 weights and computes in float32.
    assert {v.dtype.name for v in loaded.variables} == {"float32"}
    if BACKEND == "tensorflow":
        assert not {"float16", "bfloat16"} & _graph_dtypes(signature)
    x, _ = _data()
    np.testing.assert_allclose(
        _serve(signature, x), _reference_forward(model, x), rtol=1e-5, atol=1e-6
    )
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


@needs_saved_model
def test_keras_mp_export_in_bfloat16(tmp_path, float16_model):
    """A float16 model served from a bfloat16 copy."""
    model = float16_model
    path = str(tmp_path / "served")
    keras_mp.export(model, path, dtype="bfloat16", verbose=False)
    loaded, signature = _load(path)
    _assert_float32_signature(signature)
    assert "bfloat16" in {v.dtype.name for v in loaded.variables}
    x, _ = _data()
    np.testing.assert_allclose(
        _serve(signature, x), model.predict(x, verbose=0), **_tolerance("bfloat16")
    )


def test_serving_copy_in_half(bfloat16_model):
    """A bfloat16 model's float16 copy: half variables, BatchNorm kept in
    float32, float32 out."""
    model = bfloat16_model
    copy = keras_mp.serving_copy(model, "float16")
    assert _layer(copy, "hidden").dtype_policy.name == "float16"
    assert keras.backend.standardize_dtype(_layer(copy, "hidden").kernel.dtype) == "float16"
    assert _layer(copy, "bn").dtype_policy.name == "float32"  # keep_batchnorm_fp32
    x, _ = _data()
    out = copy(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(_numpy(out), model.predict(x, verbose=0), **_tolerance("bfloat16"))


# The tests below train their model further.


def test_serving_copy_computes_in_float32_and_leaves_the_model_alone(bfloat16_model):
    """The float32 copy of a model with half variables (a subclassed one,
    rebuilt from its config): float32 everywhere, the same weights, the
    float64 forward pass to float32's rounding; the model's weights,
    policies and compile config untouched, and it still trains."""
    model = bfloat16_model
    weights = [w.copy() for w in model.get_weights()]
    policies = _policies(model)
    config = model.get_compile_config()

    copy = keras_mp.serving_copy(model, "float32")
    assert copy is not model and not copy.compiled
    assert {layer.dtype_policy.name for layer in copy._flatten_layers()} == {"float32"}
    assert {keras.backend.standardize_dtype(w.dtype) for w in copy.weights} == {"float32"}
    # Same weights (half values are exact in float32).
    for w, c in zip(model.weights, copy.weights):
        np.testing.assert_array_equal(_numpy(c), _numpy(w).astype("float32"))
    x, y = _data()
    np.testing.assert_allclose(_numpy(copy(x)), _reference_forward(model, x), rtol=1e-5, atol=1e-6)

    # The training model is untouched and still trains.
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert _policies(model) == policies
    assert model.get_compile_config() == config
    model.fit(x, y, epochs=1, verbose=0)


def test_a_serving_copy_never_touches_its_model(tmp_path, float16_model):
    """Used, exported and deleted, a serving copy leaves its model exactly as
    it was: the model predicts, trains, saves and reloads bit for bit as a
    twin that never had a copy. (On JAX the copy's float32 weights were the
    model's own arrays, and `predict` donates its arguments: the copy's
    first `predict` deleted the model's weights.)"""
    model = float16_model
    model.save(str(tmp_path / "twin.keras"))
    x, y = _data()
    before = model.predict(x, verbose=0)

    copy = keras_mp.serving_copy(model)
    copy.predict(x, verbose=0)
    if BACKEND == "torch":
        spec = keras.InputSpec(shape=x.shape, dtype="float32")
        copy.export(str(tmp_path / "copy.pt2"), format="torch", input_signature=[spec])
    else:
        copy.export(str(tmp_path / "copy"), verbose=False)
    del copy
    gc.collect()

    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    twin = keras.models.load_model(str(tmp_path / "twin.keras"))
    for trained in (model, twin):
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for mine, twins in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_array_equal(mine, twins)
    model.save(str(tmp_path / "after.keras"))
    reloaded = keras.models.load_model(str(tmp_path / "after.keras"))
    np.testing.assert_array_equal(reloaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.one_backend
@pytest.mark.parametrize("dtype", ["float64", "mixed_float16", 16, None])
def test_export_rejects_unknown_dtype(tmp_path, float16_model, dtype):
    with pytest.raises(
        ValueError, match=r"`dtype` must be one of float32, float16, bfloat16.*Received: dtype="
    ):
        keras_mp.export(float16_model, str(tmp_path / "x"), dtype=dtype)


@pytest.mark.one_backend
def test_export_rejects_non_models(tmp_path):
    with pytest.raises(TypeError, match="Received: model="):
        keras_mp.export("model.keras", str(tmp_path / "x"))
    with pytest.raises(TypeError, match="`model` must be a `keras.Model`"):
        keras_mp.serving_copy(keras.layers.Dense(2))
    with pytest.raises(ValueError, match="must be built"):
        keras_mp.serving_copy(Subclassed())


@pytest.mark.skipif(BACKEND != "torch", reason="the PyTorch backend's limitation")
@pytest.mark.slow(reason="the workaround it names, run as written: TensorFlow started in a process")
def test_torch_says_how_to_export(tmp_path, float16_model):
    """From PyTorch: a clear error, and the workaround it names works."""
    model = float16_model
    with pytest.raises(NotImplementedError, match="torch_xla.*KERAS_BACKEND=tensorflow"):
        keras_mp.export(model, str(tmp_path / "x"))
    keras_path = str(tmp_path / "model.keras")
    model.save(keras_path)
    x, _ = _data()
    np.save(str(tmp_path / "x.npy"), x)
    np.save(str(tmp_path / "expected.npy"), model.predict(x, verbose=0))
    script = textwrap.dedent(
        f"""
        import numpy as np, keras, keras_mp, tensorflow as tf
        served = {str(tmp_path / "served")!r}
        keras_mp.export(keras.models.load_model({keras_path!r}), served, verbose=False)
        loaded = tf.saved_model.load(served)
        out = loaded.serve(tf.constant(np.load({str(tmp_path / "x.npy")!r}))).numpy()
        expected = np.load({str(tmp_path / "expected.npy")!r})
        np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-3)
        print("served", out.dtype)
        """
    )
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served float32" in result.stdout
