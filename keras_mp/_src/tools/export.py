"""Serving a mixed-precision model: export a copy in the precision it is served in.

A model trained at O1/O2/O3 exports with `model.export(path, format=...)`:
its inputs and outputs are float32 (keras_mp keeps the model's outputs
float32 at every level). What that artifact computes is the training
precision where the format's runtime runs it (`export_formats`), and a
float32 copy where it does not. `export` writes a copy of the model in the
precision it will be served in (float32 for a CPU, which runs float16
kernels one to two orders of magnitude slower), without touching the model
being trained: `serving_copy` shares no buffer with it.
"""

import functools
import warnings

import keras
import numpy as np

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision.loadable_config import without_records
from keras_mp._src.precision.policies import apply_amp
from keras_mp._src.precision.policies import check_model
from keras_mp._src.precision.policies import is_amp_model
from keras_mp._src.tools import export_formats

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

    A model trained with FP8 matmuls (`amp_dtype="float8"`) is copied
    without them: its Dense and EinsumDense layers compute in `dtype` from
    the trained weights, and their scales and amax histories stay behind.

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
    # A copy for serving: no optimizer, no loss, no amp compile; its matmuls
    # in the dtype it serves in (FP8 is how the model trained, not a format).
    config.pop("compile_config", None)
    # Nor the precision the model's layers compute in: the copy's own is set below.
    config = _without_float8(without_records(config))
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
    try:
        copy(*args)
    except Exception:  # noqa: BLE001
        # A model whose `call` takes more than its inputs: the copy serves in
        # memory all the same, and `export` takes an `input_signature`.
        pass


def _without_float8(config):
    """`config` with each of Keras's float8 policies replaced by the policy
    it computes like around its FP8 matmul."""
    if isinstance(config, dict):
        if config.get("class_name") == "QuantizedFloat8DTypePolicy":
            source = config.get("config", {}).get("source_name", "float32")
            return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": source}}
        return {k: _without_float8(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_without_float8(v) for v in config]
    return config


def _is_float8_state(variable):
    """A float8 layer's scale or amax history (the optimizer overwrites it
    with its new value): training state the serving copy does without."""
    return getattr(variable, "overwrite_with_gradient", False)


def _copy_weights(source, target):
    source_weights = [w for w in source.weights if not _is_float8_state(w)]
    target_weights = [w for w in target.weights if not _is_float8_state(w)]
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
    export_formats.check_format(format)
    export_formats.check_servable(dtype, format)
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
    return export_formats.write(copy, filepath, format, verbose, input_signature, kwargs)


def export_served(
    self, filepath, format="tf_saved_model", verbose=None, input_signature=None, **kwargs
):
    """`keras.Model.export`, for the models whose precision keras_mp set:
    what the format's runtime can run (`served_dtype`). Other models get
    Keras's own."""
    if not is_amp_model(self):
        return export_formats.keras_export(
            self,
            filepath,
            format=format,
            verbose=verbose,
            input_signature=input_signature,
            **kwargs,
        )
    export_formats.check_format(format)
    dtype = export_formats.served_dtype(self, format)
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
    return export_formats.write(self, filepath, format, verbose, input_signature, kwargs)


def install():
    """`keras.Model.export` serves what each format's runtime runs, for the
    models whose precision keras_mp set (idempotent)."""
    keras.Model.export = functools.wraps(export_formats.keras_export)(export_served)
