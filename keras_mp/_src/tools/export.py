"""Serving a mixed-precision model: export a copy in the precision it is served in.

A model trained at O1/O2/O3 exports as it is with `model.export(path)`: its
inputs and outputs are float32 (keras_mp keeps the model's outputs float32 at
every level), so the serving signature takes and returns float32. What that
artifact computes is the training precision, though: float16 kernels, which a
CPU runs one to two orders of magnitude slower than float32. `export` writes a
copy of the model re-traced in the precision it will be served in, without
touching the model being trained.
"""

import contextlib
import functools
import logging
import os
import tempfile
import warnings

import keras
import numpy as np

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision.policies import apply_amp
from keras_mp._src.precision.policies import check_model
from keras_mp._src.precision.policies import is_amp_model

SERVING_DTYPES = ("float32", "float16", "bfloat16")


def _check_dtype(dtype):
    name = getattr(dtype, "name", dtype)
    if name not in SERVING_DTYPES:
        raise ValueError(
            f"`dtype` must be one of {', '.join(SERVING_DTYPES)} (the precision "
            f"the exported model computes in). Received: dtype={dtype!r}"
        )
    return name


def serving_copy(model, dtype="float32"):
    """A copy of `model` computing in `dtype`, with the same weights.

    - `"float32"`: every layer computes in float32 with float32 variables (the
      `O0` level): full speed on a CPU.
    - `"float16"` / `"bfloat16"`: every layer computes in half with half
      variables, BatchNorm kept in float32 (`O3` with
      `keep_batchnorm_fp32=True`): half the memory for GPU (or bfloat16 CPU)
      serving.

    Inputs and outputs stay float32 in every case. The copy has no optimizer
    and is not compiled; `model` itself is not changed.

    Args:
        model: a built `keras.Model` (Sequential, functional or subclassed).
        dtype: `"float32"`, `"float16"` or `"bfloat16"`.

    Returns:
        A new `keras.Model`.
    """
    check_model(model)
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    dtype = _check_dtype(dtype)
    if not model.built:
        raise ValueError(
            f"`model` must be built before it is exported (call it on a batch "
            f"of data, or `fit` it). Received: model={model.name!r}, unbuilt"
        )
    with warnings.catch_warnings():
        # Keras warns about lambdas in the compile config, dropped just below.
        warnings.simplefilter("ignore", UserWarning)
        config = keras.saving.serialize_keras_object(model)
    # A copy for serving: no optimizer, no loss, no amp compile.
    config.pop("compile_config", None)
    # The model's own classes, registered with Keras or not.
    classes = {}
    for layer in keras_internals.all_layers(model):
        cls = type(layer)
        classes[cls.__name__] = cls
        classes[keras.saving.get_registered_name(cls)] = cls
    copy = keras.saving.deserialize_keras_object(config, custom_objects=classes)
    if not copy.built:
        raise ValueError(
            f"Could not rebuild a copy of model {model.name!r} from its config "
            "to export it. Give its class a `build` method (or a "
            "`build_config`) so that Keras can rebuild it."
        )
    _copy_weights(model, copy)
    if dtype == "float32":
        apply_amp(copy, "O0")
    else:
        apply_amp(copy, "O3", dtype, keep_batchnorm_fp32=True)
    _call_like(copy, _input_signature(model))
    return copy


def _input_signature(model):
    """The model's own inputs as Keras exports them, or None for a model
    never called (built by `build` only): then Keras asks for one."""
    try:
        return keras_internals.get_input_signature(model)
    except ValueError:
        return None


def _call_like(copy, input_signature):
    """A symbolic call on the model's inputs: the copy has been called, as
    the model had, so that every format of `copy.export` finds its inputs
    (ONNX refuses a model never called)."""
    if input_signature is None:
        return
    args = keras.tree.map_structure(
        lambda spec: keras.KerasTensor(spec.shape, dtype=spec.dtype), input_signature
    )
    copy(*args)


def _copy_weights(source, target):
    source_weights, target_weights = source.weights, target.weights
    shapes = [tuple(w.shape) for w in source_weights]
    if shapes != [tuple(w.shape) for w in target_weights]:
        raise ValueError(
            f"The copy of model {source.name!r} rebuilt from its config does "
            "not have the same weights as the model (its `get_config` does not "
            "describe it fully), so it cannot be exported in another dtype. "
            f"Model weights: {shapes}; copy: "
            f"{[tuple(w.shape) for w in target_weights]}"
        )
    for s, t in zip(source_weights, target_weights):
        # A copy in host memory of its own, never the model's buffer: a cast
        # to the same dtype is the same array on JAX (whose `predict` donates
        # its arguments: the model's weights would be deleted with the
        # copy's), and NumPy shares a CPU tensor's memory on PyTorch.
        t.assign(np.array(keras.ops.convert_to_numpy(s.value), copy=True))


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
_keras_export = keras.Model.export


def _check_format(format):
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


def export(
    model,
    filepath,
    dtype="float32",
    format="tf_saved_model",
    verbose=None,
    input_signature=None,
    **kwargs,
):
    """Exports `model` for serving, computing in `dtype`.

    A model trained in float16 on a GPU can be served at full speed on a CPU
    (`dtype="float32"`, the default), or in half precision on a GPU
    (`"float16"`, `"bfloat16"`). The exported copy takes and returns float32
    in every case; the model being trained is not changed.

    Every format of `keras.Model.export` is written: `"tf_saved_model"`,
    `"onnx"`, `"litert"`, `"openvino"`, `"torch"`. `model.export(path,
    format=...)` also works on keras_mp models: it serves the precision the
    model was trained in where the format's runtime runs it, and a float32
    copy where it does not (bfloat16 for ONNX and OpenVINO, any half dtype
    for LiteRT).

    Args:
        model: a built `keras.Model`.
        filepath: where to write the artifact (as `keras.Model.export`).
        dtype: `"float32"` (default), `"float16"` or `"bfloat16"`; see
            `serving_copy`.
        format: as `keras.Model.export` (default `"tf_saved_model"`).
        verbose, input_signature, **kwargs: passed to `keras.Model.export`;
            `input_signature` defaults to the model's own inputs.

    Raises:
        ValueError: a `dtype` the format's runtime cannot run (bfloat16 in
            ONNX or OpenVINO, half in LiteRT): the message names the dtype
            that serves.
        NotImplementedError: a TensorFlow SavedModel from the PyTorch backend,
            which Keras cannot export without `torch_xla`.
    """
    check_model(model)
    dtype = _check_dtype(dtype)
    _check_format(format)
    if dtype != "float32" and dtype not in RUNTIME_HALF[format]:
        runs = " or ".join(repr(d) for d in ("float32", *RUNTIME_HALF[format]))
        raise ValueError(
            f"keras_mp.export: {_RUNTIMES[format]} cannot run a {dtype} model "
            f"(format={format!r}). Export with dtype={runs} (float32 holds "
            f"{dtype} weights exactly). Received: dtype={dtype!r}, "
            f"format={format!r}"
        )
    if format == "tf_saved_model" and not backends.current.EXPORTS_SAVED_MODEL:
        raise NotImplementedError(
            "keras_mp.export: Keras cannot export a TensorFlow SavedModel from "
            "the PyTorch backend on this machine (it needs `torch_xla`). Save "
            "the model with `model.save('model.keras')`, then in a process "
            "with KERAS_BACKEND=tensorflow (or jax): "
            "`keras_mp.export(keras.models.load_model('model.keras'), path)`. "
            "Received: format='tf_saved_model' on the torch backend"
        )
    copy = serving_copy(model, dtype)
    if input_signature is None:
        # The model's own inputs (float32), read off the model that was
        # called (the copy carries them too: `serving_copy`).
        input_signature = _input_signature(model)
    return _export_as_is(copy, filepath, format, verbose, input_signature, kwargs)


def _export_as_is(model, filepath, format, verbose, input_signature, kwargs):
    with _quiet_tensorflow_logs(verbose is False):
        if format == "openvino" and backends.current.OPENVINO_THROUGH_ONNX:
            return _openvino_through_onnx(model, filepath, verbose, input_signature, kwargs)
        return _keras_export(
            model,
            filepath,
            format=format,
            verbose=verbose,
            input_signature=input_signature,
            **kwargs,
        )


def _openvino_through_onnx(model, filepath, verbose, input_signature, kwargs):
    """OpenVINO from ONNX, where Keras's own path fails (see
    `backends.common.OPENVINO_THROUGH_ONNX`)."""
    import openvino

    with tempfile.TemporaryDirectory() as directory:
        onnx_path = os.path.join(directory, "model.onnx")
        _keras_export(
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


def export_served(
    self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs
):
    """`keras.Model.export`, for the models whose precision keras_mp set:
    what the format's runtime can run (`served_dtype`). Other models get
    Keras's own."""
    if not is_amp_model(self):
        return _keras_export(
            self,
            filepath,
            format=format,
            verbose=verbose,
            input_signature=input_signature,
            **kwargs,
        )
    _check_format(format)
    dtype = served_dtype(self, format)
    if dtype is not None:
        return export(
            self,
            filepath,
            dtype=dtype,
            format=format,
            verbose=verbose,
            input_signature=input_signature,
            **kwargs,
        )
    return _export_as_is(self, filepath, format, verbose, input_signature, kwargs)


def install():
    """`keras.Model.export` serves what each format's runtime runs, for the
    models whose precision keras_mp set (idempotent)."""
    keras.Model.export = functools.wraps(_keras_export)(export_served)


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
