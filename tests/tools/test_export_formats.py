"""Every format `keras.Model.export` writes, served by the format's own
runtime: onnxruntime, LiteRT's Interpreter, OpenVINO, `torch.export`
(`tf.saved_model`: `test_export.py`).

Each format is exported once from each backend Keras exports it from, in
the cell where keras_mp's part differs: as trained where the format's
runtime runs the model's half dtype (ONNX: float16; `torch.export`:
bfloat16), from a float32 copy where it does not (LiteRT: float16;
OpenVINO: bfloat16); and a `serving_copy`'s own export (ONNX). Inputs and
outputs are float32. References: where the artifact computes in the
model's half dtype, `predict` (within a few units of that dtype's spacing:
the same roundings, another runtime's order); where it serves a float32
copy, that copy's own float32 forward pass (within float32's). The
runtimes are the `export` extra's; a test whose runtime or converter is
missing is skipped, by name.
"""

import functools
import importlib

import keras
import numpy as np
import pytest

import keras_mp
from tests.zoo import families

BACKEND = keras.backend.backend()

# What Keras exports from each backend, besides tf_saved_model (LiteRT from
# JAX is not written by Keras; `torch.export` from PyTorch only).
FORMATS = {
    "tensorflow": ("onnx", "litert", "openvino"),
    "jax": ("onnx", "openvino"),
    "torch": ("onnx", "litert", "openvino", "torch"),
}[BACKEND]
# The converter each format needs on this backend, and its runtime.
_CONVERTERS = {
    "onnx": {"tensorflow": "tf2onnx", "jax": "jax2onnx", "torch": "onnxscript"}[BACKEND],
    "litert": {"tensorflow": "tensorflow", "torch": "litert_torch"}.get(BACKEND),
    "openvino": "jax2onnx" if BACKEND == "jax" else "openvino",
    "torch": "torch",
}
_RUNTIMES = {
    "onnx": "onnxruntime",
    "litert": "ai_edge_litert",
    "openvino": "openvino",
    "torch": "torch",
}
_SUFFIX = {
    "onnx": ".onnx",
    "litert": ".tflite",
    "openvino": ".xml",
    "torch": ".pt2",
}
BATCH = 8


def _needs(format):
    for module in (_CONVERTERS[format], _RUNTIMES[format]):
        where = (
            "in no extra: it pins typing-extensions below what Jupyter's client needs"
            if module == "litert_torch"
            else "the `export` extra"
        )
        pytest.importorskip(module, reason=f"{format}: {module} ({where})")


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
    """A model trained one epoch (BatchNorm's statistics move) at the
    level; shared by the formats."""
    keras.utils.set_random_seed(0)
    x, y = _digits()
    model = _mlp() if kind == "mlp" else _cnn()
    x = x if kind == "mlp" else x.reshape(-1, 8, 8, 1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=kind == "cnn")
    model.compile(optimizer="adam", loss=loss, amp_level=level, amp_dtype=dtype)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, x[:BATCH]


def _signature(x, format, sequence=False):
    """PyTorch's exporters fix every dimension (Keras replaces a free batch
    by 1): a static signature of the batch served. So is a sequence
    model's, as KerasHub's models are served."""
    if not (sequence or (BACKEND == "torch" and format in ("torch", "litert"))):
        return {}

    def spec(a):
        return keras.InputSpec(shape=a.shape, dtype=a.dtype)

    return {"input_signature": [keras.tree.map_structure(spec, x)]}


def _serve(format, path, x):
    """The artifact run by its format's own runtime; float32 in and out."""
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
        (details,) = interpreter.get_input_details()
        interpreter.resize_tensor_input(details["index"], x.shape)
        interpreter.allocate_tensors()
        assert details["dtype"] == np.float32
        interpreter.set_tensor(details["index"], x)
        interpreter.invoke()
        (output,) = interpreter.get_output_details()
        assert output["dtype"] == np.float32
        return interpreter.get_tensor(output["index"])
    if format == "openvino":
        ov = importlib.import_module("openvino")
        # float32 arithmetic: the CPU plugin's default on AMX machines is bfloat16.
        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        assert [o.get_element_type() for o in compiled.outputs] == [ov.Type.f32]
        return compiled([x])[compiled.outputs[0]]
    torch = importlib.import_module("torch")
    module = torch.export.load(path).module()
    # The program runs where it was traced: Keras's device (a GPU's, if any).
    device = "cuda" if keras.backend.backend() == "torch" and torch.cuda.is_available() else "cpu"
    out = module(torch.tensor(x, device=device))
    assert out.dtype == torch.float32
    return out.detach().cpu().numpy()


def _by_name(x, inputs):
    """Inputs in the order the ONNX file names them: a dict (KerasHub's) by
    its keys."""
    if not isinstance(x, dict):
        return [np.asarray(x)]
    return [np.asarray(next(x[k] for k in x if k in i.name)) for i in inputs]


# README's support table: the half dtypes each format's runtime runs. A
# model computing in another is served from a float32 copy.
RUNS_HALF = {
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


# (format, model, road) per backend: each format once, in the cell whose
# code differs; the rest of the roads and levels run the same keras_mp code
# (`served_dtype`, `serving_copy`, Keras's exporter on a float32 model).
CELLS = [
    ("onnx", "mlp_O2_float16", "model.export"),  # as trained, float16 inside
    ("litert", "mlp_O2_float16", "model.export"),  # a float32 copy: no half
    ("openvino", "cnn_O3_bfloat16", "model.export"),  # a float32 copy: no bfloat16
    ("torch", "cnn_O3_bfloat16", "model.export"),  # as trained, bfloat16 inside
    # A copy's own export: its inputs are those of the call `serving_copy`
    # made (ONNX refuses a model never called).
    ("onnx", "cnn_O3_bfloat16", "serving_copy"),
]


@pytest.mark.parametrize(
    "format, trained, road",
    [pytest.param(*cell, id="-".join(cell)) for cell in CELLS if cell[0] in FORMATS],
)
def test_each_format_serves_what_its_runtime_runs(tmp_path, format, trained, road):
    """`model.export(path, format=...)` as a user calls it after `fit`, and
    `serving_copy(model).export(...)`: an MLP with BatchNorm (O2 float16)
    and a CNN with BatchNorm (O3 bfloat16, what no runtime but TensorFlow's
    and PyTorch's runs)."""
    kind, level, dtype = trained.split("_")
    model, x = _trained(kind, level, dtype)
    if road == "serving_copy":
        copy = keras_mp.serving_copy(model)
        served = _export_and_serve(tmp_path, format, copy.export, x)
        np.testing.assert_allclose(served, keras.ops.convert_to_numpy(copy(x)), **FLOAT32)
        np.testing.assert_allclose(served, model.predict(x, verbose=0), **_tolerance(dtype))
        return
    expected, tolerance = _expect(model, x, format, dtype)
    served = _export_and_serve(tmp_path, format, model.export, x)
    np.testing.assert_allclose(served, expected, **tolerance)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the real-model case, on one backend")
def test_a_kerashub_classifier_serves_onnx_as_trained(tmp_path):
    """KerasHub's BERT classifier at O2 float16 (integer token ids in, a
    static sequence signature as KerasHub's models are served, its
    attention, embeddings and layer norms in their precisions) exported to
    ONNX as trained, float16 inside, float32 logits out. Untrained: export
    reads its graph and weights, which training changes only in value."""
    keras.utils.set_random_seed(0)
    model, x, _, loss = families.bert()
    model.compile(optimizer="adam", loss=loss, amp_level="O2", amp_dtype="float16")
    expected, tolerance = _expect(model, x, "onnx", "float16")
    served = _export_and_serve(tmp_path, "onnx", model.export, x, sequence=True)
    np.testing.assert_allclose(served, expected, **tolerance)


@pytest.mark.one_backend
@pytest.mark.parametrize("format", ["onnx", "openvino", "litert"])
def test_a_dtype_the_runtime_cannot_run_is_refused_with_the_one_that_serves(tmp_path, format):
    model, _ = _trained("mlp", "O2", "float16")
    runs = "'float32' or 'float16'" if format != "litert" else "'float32'"
    with pytest.raises(ValueError, match=rf"cannot run a bfloat16 model \(format='{format}'\)"):
        keras_mp.export(model, str(tmp_path / "x"), dtype="bfloat16", format=format)
    with pytest.raises(ValueError, match=rf"Export with dtype={runs} \(float32 holds"):
        keras_mp.export(model, str(tmp_path / "x"), dtype="bfloat16", format=format)


@pytest.mark.one_backend
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
