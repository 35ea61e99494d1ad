"""The formats `keras.Model.export` writes, and what each one's runtime runs.

TensorFlow (SavedModel) and PyTorch (`torch.export`) run float16 and
bfloat16; onnxruntime and OpenVINO run float16 but not bfloat16; LiteRT's
interpreter runs float32 only. A keras_mp model whose half dtype the
format's runtime cannot run is served from a float32 copy (`served_dtype`),
which holds its half weights exactly. README's support table says the same.
"""

import contextlib
import logging
import os
import tempfile

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals

# What each format's own runtime runs of the half dtypes; the rest is served
# from a float32 copy (README's support table, `docs/guide.md`).
RUNTIME_HALF = {
    "tf_saved_model": ("float16", "bfloat16"),  # TensorFlow runs both
    "torch": ("float16", "bfloat16"),  # torch.export: PyTorch runs both
    # onnxruntime has no bfloat16 Relu, Conv or Einsum, and tf2onnx mixes
    # float16 and bfloat16 in one op.
    "onnx": ("float16",),
    "openvino": ("float16",),  # no bfloat16 constants
    # The interpreter's builtins are float32: a half MatMul becomes a Flex
    # op it cannot run.
    "litert": (),
}
FORMATS = tuple(RUNTIME_HALF)
_RUNTIMES = {
    "tf_saved_model": "TensorFlow",
    "torch": "PyTorch",
    "onnx": "onnxruntime",
    "openvino": "OpenVINO",
    "litert": "LiteRT's interpreter",
}
keras_export = keras.Model.export


def check_format(format):
    if format not in FORMATS:
        raise ValueError(
            f"`format` must be one of {', '.join(map(repr, FORMATS))} (the "
            f"formats `keras.Model.export` writes). Received: format={format!r}"
        )


def served_dtype(model, format):
    """What `model.export(format=...)` of a model whose precision keras_mp
    set serves: None (the model as it is) where the format's runtime runs
    every half dtype the model computes in, else `"float32"` (a float32
    copy: exact for the model's half weights)."""
    computed = {
        keras.backend.standardize_dtype(layer.compute_dtype)
        for layer in keras_internals.all_layers(model)
    }
    half = computed & {"float16", "bfloat16"}
    return None if half <= set(RUNTIME_HALF[format]) else "float32"


def check_servable(dtype, format):
    """`keras_mp.export(dtype=..., format=...)`: refuses a half dtype the
    format's runtime cannot run, naming those it can."""
    if dtype != "float32" and dtype not in RUNTIME_HALF[format]:
        runs = " or ".join(repr(d) for d in ("float32", *RUNTIME_HALF[format]))
        raise ValueError(
            f"keras_mp.export: {_RUNTIMES[format]} cannot run a {dtype} model "
            f"(format={format!r}). Export with dtype={runs} (float32 holds "
            f"{dtype} weights exactly). Received: dtype={dtype!r}, "
            f"format={format!r}"
        )


def write(model, filepath, format, verbose, input_signature, kwargs):
    """`model` exported as it is, by Keras (OpenVINO through ONNX where
    Keras's own path fails: `backends.common.OPENVINO_THROUGH_ONNX`); an
    ONNX file is run once by onnxruntime, where it is installed, so that a
    file its runtime cannot run is an error here, not a file."""
    with _quiet_tensorflow_logs(verbose is False):
        if format == "openvino" and backends.current.OPENVINO_THROUGH_ONNX:
            return _openvino_through_onnx(model, filepath, verbose, input_signature, kwargs)
        result = keras_export(
            model,
            filepath,
            format=format,
            verbose=verbose,
            input_signature=input_signature,
            **kwargs,
        )
    if format == "onnx":
        check_onnx_runs(filepath)
    return result


def check_onnx_runs(filepath):
    """Runs the ONNX file once in onnxruntime (zeros of each input's type,
    free dimensions 1); where the model itself fails to run, removes the
    file and says what to do. Skipped without onnxruntime, and for inputs
    it cannot make (a type it does not know); a rejected feed is not the
    file's fault and fails nothing."""
    try:
        import numpy as np
        import onnxruntime
    except ImportError:
        return
    session = onnxruntime.InferenceSession(str(filepath), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    if any(i.type not in _ONNX_TYPES for i in inputs):
        return
    feeds = {
        i.name: np.zeros(
            [d if isinstance(d, int) and d > 0 else 1 for d in i.shape], _ONNX_TYPES[i.type]
        )
        for i in inputs
    }
    try:
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 (onnxruntime's own errors)
        message = str(error)
        if any(s in message for s in _FEED_ERRORS):
            return
        os.remove(filepath)
        others = " or ".join(b for b in ("tensorflow", "torch") if b != backends.current.NAME)
        raise ValueError(
            f"keras_mp: onnxruntime cannot run the ONNX file {backends.current.NAME}'s "
            f"exporter wrote ({message.splitlines()[0][:300]}); it was removed. "
            "Export from another backend: `model.save('model.keras')`, then in a "
            f"process with KERAS_BACKEND={others}, "
            "`keras.models.load_model('model.keras').export(path, format='onnx')`."
        ) from error


# onnxruntime's input types, as NumPy makes their zeros.
_ONNX_TYPES = {
    f"tensor({name})": dtype
    for name, dtype in (
        ("float", "float32"),
        ("float16", "float16"),
        ("double", "float64"),
        ("int8", "int8"),
        ("int16", "int16"),
        ("int32", "int32"),
        ("int64", "int64"),
        ("uint8", "uint8"),
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("bool", "bool"),
    )
}
# onnxruntime's words for a feed it refuses (ours, not the file's fault).
_FEED_ERRORS = ("Unexpected input data type", "Got invalid dimensions", "Invalid rank")


def _openvino_through_onnx(model, filepath, verbose, input_signature, kwargs):
    """OpenVINO from ONNX, where Keras's own path fails (see
    `backends.common.OPENVINO_THROUGH_ONNX`)."""
    import openvino

    with tempfile.TemporaryDirectory() as directory:
        onnx_path = os.path.join(directory, "model.onnx")
        keras_export(
            model,
            onnx_path,
            format="onnx",
            verbose=False,
            input_signature=input_signature,
            **kwargs,
        )
        converted = openvino.convert_model(onnx_path)
        openvino.save_model(converted, str(filepath), compress_to_fp16=False)
    if verbose is not False:
        keras_internals.print_msg(f"Saved artifact at '{filepath}'.")


@contextlib.contextmanager
def _quiet_tensorflow_logs(quiet):
    """`verbose=False` silences TensorFlow's INFO lines ("Assets written to")
    too, which a notebook (or a program that logs at INFO) would show."""
    if not quiet:
        yield
        return
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
