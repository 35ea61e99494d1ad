"""Every format `keras.Model.export` writes, at every level, served by the
format's own runtime: `tf.saved_model`, onnxruntime, LiteRT's Interpreter,
OpenVINO, `torch.export`.

Each format is exported from each backend Keras exports it from, through
`model.export`, `keras_mp.export` and a `serving_copy`, and the artifact's
inputs and outputs are float32. References: where the artifact computes in
the model's half dtype, `predict` (within a few units of that dtype's
spacing: the same roundings, another runtime's order); where it serves a
float32 copy, that copy's own float32 forward pass (within float32's).
The runtimes are the `export` extra's; a test whose runtime or converter is
missing is skipped, by name.
"""

import functools
import importlib
import re

import keras
import numpy as np
import pytest

import keras_mp
from tests.zoo import families

BACKEND = keras.backend.backend()

# What Keras exports from each backend (tf_saved_model from PyTorch needs
# torch_xla; LiteRT from JAX is not written by Keras).
FORMATS = {
    "tensorflow": ("tf_saved_model", "onnx", "litert", "openvino"),
    "jax": ("tf_saved_model", "onnx", "openvino"),
    "torch": ("onnx", "litert", "openvino", "torch"),
}[BACKEND]
# The converter each format needs on this backend, and its runtime.
_CONVERTERS = {
    "onnx": {"tensorflow": "tf2onnx", "jax": "jax2onnx", "torch": "onnxscript"}[BACKEND],
    "litert": {"tensorflow": "tensorflow", "torch": "litert_torch"}.get(BACKEND),
    "openvino": "jax2onnx" if BACKEND == "jax" else "openvino",
    "tf_saved_model": "tensorflow",
    "torch": "torch",
}
_RUNTIMES = {
    "onnx": "onnxruntime",
    "litert": "ai_edge_litert",
    "openvino": "openvino",
    "tf_saved_model": "tensorflow",
    "torch": "torch",
}
_SUFFIX = {
    "tf_saved_model": "",
    "onnx": ".onnx",
    "litert": ".tflite",
    "openvino": ".xml",
    "torch": ".pt2",
}
CELLS = [
    ("O0", "float32"),
    ("O1", "float16"),
    ("O2", "float16"),
    ("O2", "bfloat16"),
    ("O3", "float16"),
    ("O3", "bfloat16"),
]
BATCH = 8


def _needs(format):
    for module in (_CONVERTERS[format], _RUNTIMES[format]):
        pytest.importorskip(module, reason=f"{format}: {module} (the `export` extra)")


def _tolerance(dtype):
    """A few units of the dtype's spacing at 1 (softmax outputs and logits
    of about 1): the artifact and `predict` round the same products, in
    another order."""
    eps = float(np.finfo(dtype).eps) if dtype != "bfloat16" else 2.0**-7
    return dict(rtol=4 * eps, atol=4 * eps)


FLOAT32 = dict(rtol=1e-5, atol=1e-5)


def _mlp():
    inputs = keras.Input((64,), name="pixels")
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def _cnn():
    inputs = keras.Input((8, 8, 1), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(10)(h)
    return keras.Model(inputs, outputs)


@functools.lru_cache(maxsize=None)
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32")[:64], y[:64].astype("int32")


@functools.lru_cache(maxsize=None)
def _trained(kind, level, dtype):
    """A model trained one epoch at the level; shared by the formats."""
    keras.utils.set_random_seed(0)
    x, y = _digits()
    if kind == "bert":
        model, x, y, loss = families.bert()
    else:
        model = _mlp() if kind == "mlp" else _cnn()
        x = x if kind == "mlp" else x.reshape(-1, 8, 8, 1)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=kind == "cnn")
    amp = dict(amp_level=level) if level == "O0" else dict(amp_level=level, amp_dtype=dtype)
    model.compile(optimizer="adam", loss=loss, **amp)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, keras.tree.map_structure(lambda a: a[:BATCH], x)


def _signature(x, format, sequence=False):
    """PyTorch's exporters fix every dimension (Keras replaces a free batch
    by 1): a static signature of the batch served. So is a sequence
    model's on every backend, as KerasHub's models are served: JAX cannot
    decide its position embedding's length check for a symbolic length, and
    jax2onnx mixes up a symbolic batch with it."""
    static = sequence or (BACKEND == "torch" and format in ("torch", "litert"))
    if not static:
        return {}

    def spec(a):
        return keras.InputSpec(shape=a.shape if static else (None, *a.shape[1:]), dtype=a.dtype)

    return {"input_signature": [keras.tree.map_structure(spec, x)]}


def _serve(format, path, x):
    """The artifact run by its format's own runtime; float32 in and out."""
    flat = [np.asarray(a) for a in keras.tree.flatten(x)]
    if format == "tf_saved_model":
        tf = importlib.import_module("tensorflow")
        loaded = tf.saved_model.load(path)
        fn = loaded.signatures["serving_default"]
        specs = fn.structured_input_signature[1]
        kwargs = {k: tf.constant(a) for k, a in zip(sorted(specs), _by_name(x, sorted(specs)))}
        (out,) = fn(**kwargs).values()
        assert out.dtype.name == "float32"
        return out.numpy()
    if format == "onnx":
        ort = importlib.import_module("onnxruntime")
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        inputs = session.get_inputs()
        assert [i.type for i in inputs if "float" in i.type] in ([], ["tensor(float)"])
        assert [o.type for o in session.get_outputs()] == ["tensor(float)"]
        return session.run(None, {i.name: a for i, a in zip(inputs, _by_name(x, inputs))})[0]
    if format == "litert":
        interpreter = importlib.import_module("ai_edge_litert.interpreter").Interpreter(
            model_path=path
        )
        details = interpreter.get_input_details()
        flat = _by_name(x, [_flat_position(d["name"]) for d in details])
        for d, a in zip(details, flat):
            interpreter.resize_tensor_input(d["index"], a.shape)
        interpreter.allocate_tensors()
        for d, a in zip(details, flat):
            assert d["dtype"] == a.dtype
            interpreter.set_tensor(d["index"], a)
        interpreter.invoke()
        (output,) = interpreter.get_output_details()
        assert output["dtype"] == np.float32
        return interpreter.get_tensor(output["index"])
    if format == "openvino":
        ov = importlib.import_module("openvino")
        # float32 arithmetic: the CPU plugin's default on AMX machines is bfloat16.
        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        assert [o.get_element_type() for o in compiled.outputs] == [ov.Type.f32]
        flat = _by_name(x, [" ".join(sorted(i.get_names())) for i in compiled.inputs])
        return compiled(flat)[compiled.outputs[0]]
    torch = importlib.import_module("torch")
    module = torch.export.load(path).module()
    # The program runs where it was traced: Keras's device (a GPU's, if any).
    device = "cuda" if keras.backend.backend() == "torch" and torch.cuda.is_available() else "cpu"
    out = module(keras.tree.map_structure(lambda v: torch.tensor(v, device=device), x))
    assert out.dtype == torch.float32
    return out.detach().cpu().numpy()


def _flat_position(name):
    """LiteRT names a structure's tensors by their place in it:
    `serving_default_args_0:0`, `..._args_0_1:0`, ... (listed in another
    order)."""
    match = re.search(r"args_0(?:_(\d+))?:\d+$", name)
    return int(match.group(1) or 0) if match else name


def _by_name(x, inputs):
    """Inputs in the order the artifact names them (a dict by its keys), or
    in `keras.tree.flatten`'s order (sorted keys) where its inputs are
    positional (`input_0`, ...: PyTorch's exporters)."""
    flat = [np.asarray(a) for a in keras.tree.flatten(x)]
    if not isinstance(x, dict):
        return flat
    names = [getattr(i, "name", i) for i in inputs]
    if all(isinstance(n, int) for n in names):
        return [flat[n] for n in names]
    keys = [next((k for k in x if k in n), None) for n in names]
    return flat if None in keys else [np.asarray(x[k]) for k in keys]


# README's support table: the half dtypes each format's runtime runs. A
# model computing in another is served from a float32 copy.
RUNS_HALF = {
    "tf_saved_model": {"float16", "bfloat16"},
    "torch": {"float16", "bfloat16"},
    "onnx": {"float16"},
    "openvino": {"float16"},
    "litert": set(),
}


def _expect(model, x, format, dtype):
    """What the artifact of `model.export` computes, and its reference."""
    if dtype == "float32" or dtype not in RUNS_HALF[format]:
        copy = keras_mp.serving_copy(model)
        return keras.ops.convert_to_numpy(copy(x)), FLOAT32
    return model.predict(x, verbose=0), _tolerance(dtype)


def _export_and_serve(tmp_path, format, export, x, sequence=False):
    _needs(format)
    path = str(tmp_path / f"served{_SUFFIX[format]}")
    export(path, format=format, verbose=False, **_signature(x, format, sequence))
    return _serve(format, path, x)


@pytest.mark.parametrize("level, dtype", CELLS)
@pytest.mark.parametrize("format", FORMATS)
def test_model_export_serves_every_format_at_every_level(tmp_path, format, level, dtype):
    """`model.export(path, format=...)` as a user calls it after `fit`."""
    model, x = _trained("mlp", level, dtype)
    expected, tolerance = _expect(model, x, format, dtype)
    served = _export_and_serve(tmp_path, format, model.export, x)
    np.testing.assert_allclose(served, expected, **tolerance)


@pytest.mark.parametrize("how", ["keras_mp.export", "serving_copy"])
@pytest.mark.parametrize("format", FORMATS)
def test_a_float32_copy_serves_every_format(tmp_path, format, how):
    """A CNN with BatchNorm trained at O3 bfloat16 (what no runtime but
    TensorFlow and PyTorch runs): `keras_mp.export(..., format=...)` and
    `serving_copy(model).export(format=...)` serve it in float32."""
    model, x = _trained("cnn", "O3", "bfloat16")
    if how == "keras_mp.export":
        export = functools.partial(keras_mp.export, model)
    else:
        export = keras_mp.serving_copy(model).export
    served = _export_and_serve(tmp_path, format, export, x)
    expected = keras.ops.convert_to_numpy(keras_mp.serving_copy(model)(x))
    np.testing.assert_allclose(served, expected, **FLOAT32)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), **_tolerance("bfloat16"))


@pytest.mark.parametrize("format", FORMATS)
def test_a_kerashub_classifier_serves_every_format(tmp_path, format):
    """KerasHub's BERT classifier (integer token ids in, float32 logits
    out) trained at O2 float16, exported as users do."""
    model, x = _trained("bert", "O2", "float16")
    expected, tolerance = _expect(model, x, format, "float16")
    served = _export_and_serve(tmp_path, format, model.export, x, sequence=True)
    np.testing.assert_allclose(served, expected, **tolerance)


@pytest.mark.parametrize("format", ["onnx", "openvino", "litert"])
def test_a_dtype_the_runtime_cannot_run_is_refused_with_the_one_that_serves(tmp_path, format):
    model, _ = _trained("mlp", "O2", "float16")
    runs = "'float32' or 'float16'" if format != "litert" else "'float32'"
    with pytest.raises(ValueError, match=rf"cannot run a bfloat16 model \(format='{format}'\)"):
        keras_mp.export(model, str(tmp_path / "x"), dtype="bfloat16", format=format)
    with pytest.raises(ValueError, match=f"Export with dtype={runs}"):
        keras_mp.export(model, str(tmp_path / "x"), dtype="bfloat16", format=format)


@pytest.mark.parametrize("format", ["tf-saved-model", "keras", "pb", None])
def test_an_unknown_format_is_refused_by_name(tmp_path, format):
    model, _ = _trained("mlp", "O2", "float16")
    with pytest.raises(ValueError, match=r"`format` must be one of .*Received: format="):
        keras_mp.export(model, str(tmp_path / "x"), format=format)


def test_an_onnx_file_its_runtime_cannot_run_is_an_error_not_a_file(tmp_path):
    """Issue 63.9: on JAX, a CNN with MaxPooling2D exported to ONNX was
    written and onnxruntime refused it at run time ("Unsupported pooling
    size"). Each ONNX export now runs once in onnxruntime: on JAX the export
    fails, the file removed, naming the backend to export from; on
    TensorFlow and PyTorch the file runs."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer="adam", loss="mse", amp_level="O3", amp_dtype="bfloat16")
    model(np.zeros((2, 8, 8, 1), "float32"))
    path = tmp_path / "cnn.onnx"
    if keras.backend.backend() == "jax":
        with pytest.raises(ValueError, match="onnxruntime cannot run.*KERAS_BACKEND=tensorflow"):
            model.export(path, format="onnx", verbose=False)
        assert not path.exists()
        return
    model.export(path, format="onnx", verbose=False)
    session = onnxruntime.InferenceSession(str(path))
    feed = {session.get_inputs()[0].name: np.zeros((2, 8, 8, 1), "float32")}
    assert session.run(None, feed)[0].shape == (2, 3)


def test_the_onnx_check_feeds_each_input_its_own_type(tmp_path):
    """A model taking uint8 pixels (a `Rescaling` first): onnxruntime runs
    the file with uint8 zeros, and the export keeps it (review of issue 63:
    float32 zeros were fed, refused, and the file removed)."""
    onnxruntime = pytest.importorskip("onnxruntime")
    if keras.backend.backend() == "jax":
        pytest.skip("jax2onnx keeps Keras's float32 input")
    inputs = keras.Input((4,), dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile(optimizer="adam", loss="mse", amp_level="O2", amp_dtype="float16")
    model(np.zeros((2, 4), "uint8"))
    path = tmp_path / "pixels.onnx"
    model.export(path, format="onnx", verbose=False)
    session = onnxruntime.InferenceSession(str(path))
    assert session.get_inputs()[0].type == "tensor(uint8)"
