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
    """Runs the ONNX file once in onnxruntime (zeros, batch 1); where it
    fails, removes the file and says what to do. Skipped without
    onnxruntime."""
    try:
        import numpy as np
        import onnxruntime
    except ImportError:
        return
    feeds = None
    try:
        session = onnxruntime.InferenceSession(str(filepath), providers=["CPUExecutionProvider"])
        feeds = {
            i.name: np.zeros(
                [d if isinstance(d, int) and d > 0 else 1 for d in i.shape],
                _ONNX_TYPES.get(i.type, "float32"),
            )
            for i in session.get_inputs()
        }
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 (onnxruntime's own errors)
        os.remove(filepath)
        raise ValueError(
            f"keras_mp: onnxruntime cannot run the ONNX file {backends.current.NAME}'s "
            f"exporter wrote ({str(error).splitlines()[0][:300]}); it was removed. "
            "Export from another backend: `model.save('model.keras')`, then in a "
            "process with KERAS_BACKEND=tensorflow (or torch), "
            "`keras.models.load_model('model.keras').export(path, format='onnx')`."
        ) from error


_ONNX_TYPES = {"tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool"}
_ONNX_TYPES.update({"tensor(float16)": "float16", "tensor(double)": "float64"})


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
