"""The precision doctor: what half precision does to a model's numbers.

`analyze(model, x, y)` runs one batch through the model and reports, per
layer, the largest activation against the half dtype's range, and the share
of gradient values that float16 would flush to zero (underflow) or turn into
inf (overflow) at the current loss scale and at the recommended one -- the
gradient histogram of MindSpore's loss-scale tutorial, made a tool.

Three passes over the batch:

1. a forward pass in the model's own policy (what training computes: an
   activation that overflows there shows up as non-finite);
2. a forward pass of a float32 copy (`serving_copy`): the true magnitudes of
   the activations, even where (1) overflowed;
3. a forward and backward pass of that float32 copy: the true gradients, so
   that values half precision would flush to zero are still seen and can be
   counted at any loss scale.

The model itself is not changed (no weights, no BatchNorm statistics, no
optimizer state).
"""

import math

import keras
import numpy as np

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision.layer_kinds import DENY_LIST
from keras_mp._src.precision.layer_tree import layers_in_order
from keras_mp._src.precision.levels import check_half_dtype
from keras_mp._src.precision.policies import check_model
from keras_mp._src.tools.doctor_report import PrecisionReport
from keras_mp._src.tools.doctor_report import percent
from keras_mp._src.tools.doctor_report import render
from keras_mp._src.tools.export import serving_copy
from keras_mp._src.tools.half_range import HALF_RANGE
from keras_mp._src.tools.half_range import overflow_share
from keras_mp._src.tools.half_range import recommended_loss_scale
from keras_mp._src.tools.half_range import underflow_share

# An activation above this share of the half dtype's maximum is flagged.
_ACTIVATION_LIMIT = 0.5


def analyze(
    model,
    x,
    y=None,
    loss=None,
    dtype=None,
    loss_scale=None,
    sample_weight=None,
    print_fn=print,
):
    """Checks a model's activations and gradients against half precision.

    Args:
        model: a `keras.Model` (built, or built by this call).
        x, y: one batch of inputs and targets (what `fit` would get).
        loss: the loss; default: the model's compiled loss.
        dtype: the half dtype to check against; default: the one the model
            computes in, or `"float16"` for a float32 model (to plan a switch).
        loss_scale: the scale to evaluate; default: the model's
            LossScaleOptimizer's current scale, else 1.
        sample_weight: optional, as in `fit`.
        print_fn: called with the report's text (default `print`); None to
            stay silent.

    Returns:
        A `PrecisionReport`: print it for the table (`.text`); `.rows` (one
        dict per layer: `layer`, `class`, `compute_dtype`, `max_activation` (float32
        pass), `activation_share_of_max`, `finite_in_policy`,
        `gradient_values`, `max_gradient`, `underflow_current`,
        `underflow_recommended`, `overflow_current`, `overflow_recommended`,
        `keep_float32`, `reason`), `.recommended_loss_scale`,
        `.current_loss_scale`, `.keep_float32`, `.gradients` and `.plot()`.
    """
    check_model(model)
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a `keras.Model`. Received: model={model!r} "
            f"of type {type(model).__name__}"
        )
    if y is None:
        raise ValueError(
            "`y` is needed: the doctor measures the gradients of the loss. Received: y=None"
        )
    if not model.built:
        model(x)
    layers = _computing_layers(model)
    half = _half_dtype(layers, dtype)
    scale = _current_scale(model, loss_scale)
    loss_fn = _loss(model, loss)

    in_policy = _record_activations(model, layers, x)
    copy = serving_copy(model, "float32")
    copy_layers = _computing_layers(copy)
    in_float32 = _record_activations(copy, copy_layers, x)
    gradients = backends.current.float32_gradients(copy, x, y, loss_fn, sample_weight)
    by_variable = {
        id(v): np.asarray(keras.ops.convert_to_numpy(g), dtype="float32")
        for v, g in zip(model.trainable_variables, gradients)
    }
    all_values = list(by_variable.values())
    recommended, advice = _recommendation(all_values, scale, half)
    largest = HALF_RANGE[half][0]

    rows = []
    for layer, twin in zip(layers, copy_layers):
        max_act = in_float32.get(id(twin), (None, True))[0]
        finite = in_policy.get(id(layer), (None, True))[1]
        own = [v for v in keras_internals.own_trainable_variables(layer) if id(v) in by_variable]
        grads = [by_variable[id(v)] for v in own]
        values = np.concatenate([g.ravel() for g in grads]) if grads else np.zeros(0, "float32")
        reasons = []
        if max_act is not None and max_act > _ACTIVATION_LIMIT * largest:
            reasons.append(
                f"activations reach {max_act:.3g}, "
                f"{max_act / largest:.0%} of {half}'s maximum {largest:g}"
            )
        if not finite:
            reasons.append(f"not finite when computed in {layer.compute_dtype}")
        if isinstance(layer, DENY_LIST) and layer.compute_dtype in HALF_RANGE:
            reasons.append("a normalisation/softmax computing in half")
        rows.append(
            {
                "layer": layer.path if getattr(layer, "path", None) else layer.name,
                "class": type(layer).__name__,
                "compute_dtype": layer.compute_dtype,
                "max_activation": max_act,
                "activation_share_of_max": None if max_act is None else max_act / largest,
                "finite_in_policy": finite,
                "gradient_values": int(values.size),
                "max_gradient": float(np.max(np.abs(values))) if values.size else None,
                "underflow_current": underflow_share(values, scale, half) if values.size else None,
                "underflow_recommended": underflow_share(values, recommended, half)
                if values.size
                else None,
                "overflow_current": overflow_share(values, scale, half) if values.size else None,
                "overflow_recommended": overflow_share(values, recommended, half)
                if values.size
                else None,
                "keep_float32": bool(reasons),
                "reason": "; ".join(reasons),
            }
        )

    report = PrecisionReport(
        text=render(rows, half, scale, recommended, advice, all_values),
        rows=rows,
        dtype=half,
        current_loss_scale=scale,
        recommended_loss_scale=recommended,
        advice=advice,
        keep_float32=[r["layer"] for r in rows if r["keep_float32"]],
        gradients={v.path: by_variable[id(v)] for v in model.trainable_variables},
    )
    if print_fn is not None:
        print_fn(report.text)
    return report


def _recommendation(gradients, scale, half):
    """(scale to recommend, why): a change only where it loses fewer values.

    The candidate is `recommended_loss_scale`: the largest power of two that
    keeps every gradient finite with headroom. It is recommended when the
    current scale overflows (every such step would be skipped), or when it
    flushes fewer gradient values to zero than the current scale does.
    Otherwise the current scale is kept: a larger one gains nothing when
    nothing underflows, and a smaller one only loses values.
    """
    if half == "bfloat16":
        return 1.0, "bfloat16 has float32's range: no loss scaling needed."
    candidate = recommended_loss_scale(gradients, half)
    values = np.concatenate([np.abs(g).ravel() for g in gradients] or [np.zeros(0)])
    if overflow_share(values, scale, half) > 0:
        return (
            candidate,
            f"the current scale {scale:g} overflows {half}; "
            f"2**{int(math.log2(candidate))} keeps every gradient finite.",
        )
    now, then = underflow_share(values, scale, half), underflow_share(values, candidate, half)
    if then < now:
        return candidate, (
            f"2**{int(math.log2(candidate))} flushes {percent(then)} of the gradient "
            f"values to zero, the current {scale:g} {percent(now)}."
        )
    if now == 0:
        return scale, f"keep the current {scale:g}: no gradient value underflows or overflows."
    return scale, (
        f"keep the current {scale:g}: a scale that keeps every gradient finite "
        "loses as many values or more."
    )


def _half_dtype(layers, dtype):
    if dtype is not None:
        return check_half_dtype(dtype, "dtype")
    for layer in layers:
        if layer.compute_dtype in HALF_RANGE:
            return layer.compute_dtype
    return "float16"


def _current_scale(model, loss_scale):
    if loss_scale is not None:
        if (
            isinstance(loss_scale, bool)
            or not isinstance(loss_scale, (int, float))
            or not (0 < loss_scale < float("inf"))
        ):
            raise ValueError(
                "`loss_scale` must be a positive finite number or None (the "
                f"model's current scale). Received: loss_scale={loss_scale!r}"
            )
        return float(loss_scale)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return float(np.asarray(keras.ops.convert_to_numpy(optimizer.dynamic_scale)))
    return 1.0


def _loss(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "`loss` is needed: the model is not compiled with a loss. "
                "Pass e.g. loss='sparse_categorical_crossentropy'. Received: loss=None"
            )
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "The doctor takes one loss (a single-output model). Pass `loss=` "
            f"explicitly. Received: loss={loss!r}"
        )
    loss = keras.losses.get(loss)
    if not isinstance(loss, keras.losses.Loss):
        # A plain function of (y_true, y_pred): reduced as `compile` does.
        loss = keras_internals.LossFunctionWrapper(loss)
    return loss


def _computing_layers(model):
    """The layers that compute (no models, no inputs), in the order they run:
    the same walk for the model and its float32 copy, so the two line up."""
    return [
        layer
        for layer in layers_in_order(model)
        if not isinstance(layer, (keras.Model, keras.layers.InputLayer))
    ]


def _record_activations(model, layers, x):
    """{id(layer): (max |output| as float, all finite)} for one forward pass."""
    seen = {}
    saved = []

    def recorder(layer, call):
        def call_and_record(*args, **kwargs):
            outputs = call(*args, **kwargs)
            for out in keras.tree.flatten(outputs):
                if not hasattr(out, "dtype") or not keras.backend.is_float_dtype(
                    keras.backend.standardize_dtype(out.dtype)
                ):
                    continue
                out32 = keras.ops.cast(out, "float32")
                finite = keras.ops.isfinite(out32)
                magnitude = keras.ops.where(finite, keras.ops.abs(out32), 0.0)
                peak = float(np.asarray(keras.ops.convert_to_numpy(keras.ops.max(magnitude))))
                ok = bool(np.asarray(keras.ops.convert_to_numpy(keras.ops.all(finite))))
                old_peak, old_ok = seen.get(id(layer), (0.0, True))
                seen[id(layer)] = (max(old_peak, peak), old_ok and ok)
            return outputs

        return call_and_record

    for layer in layers:
        saved.append((layer, layer.__dict__.get("call")))
        object.__setattr__(layer, "call", recorder(layer, layer.call))
    try:
        model(x, training=False)
    finally:
        for layer, previous in saved:
            if previous is None:
                del layer.__dict__["call"]
            else:
                object.__setattr__(layer, "call", previous)
    return seen
