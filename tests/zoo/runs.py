"""How the zoo's tests run a family: each model built once per process, put
back to its float32 weights before each use; its outputs; a few steps on the
whole batch, and the float32 model's steps they are compared with."""

import keras
import numpy as np

import keras_mp
from tests.zoo import families

BACKEND = keras.backend.backend()
JAX = BACKEND == "jax"
TORCH = BACKEND == "torch"
HALF = ("float16", "bfloat16")
LEVELS = ("O1", "O2", "O3")


def np64(x):
    return keras.ops.convert_to_numpy(x).astype("float64")


def batch(x):
    """How many examples `x` holds (a dict of inputs too): one batch."""
    return len(keras.tree.flatten(x)[0])


def outputs(model, x):
    """The model's outputs on `x`, flattened: one compiled `predict` on JAX
    (an eager call compiles each op on its first use), a call elsewhere."""
    if JAX:
        return keras.tree.flatten(model.predict(x, batch_size=batch(x), verbose=0))
    return keras.tree.flatten(model(x, training=False))


_BUILT = {}


def model(family):
    """`(model, x, y, loss)`: the family's model, built once per process
    (seed 0), at O0 with its first weights. No dropout: the steps are
    compared with float32's, whose masks would be other draws (and on
    TensorFlow a mask drawn in float16 is another mask)."""
    if family not in _BUILT:
        keras.config.set_dtype_policy("float32")
        keras.utils.set_random_seed(0)
        built, x, y, loss = getattr(families, family)()
        for layer in built._flatten_layers():
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        _BUILT[family] = (built, x, y, loss, built.get_weights())
    built, x, y, loss, weights = _BUILT[family]
    keras_mp.apply_amp(built, "O0")
    built.set_weights(weights)
    return built, x, y, loss


def built_under_keras_mixed_float16(family):
    """The family's model (the same weights as `model`'s) under Keras's own
    `mixed_float16` policy."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        keras_model, _, _, _ = getattr(families, family)()
        return keras_model
    finally:
        keras.config.set_dtype_policy("float32")


def keras_mixed_float16_outputs(family, x):
    """The family's outputs under Keras's own `mixed_float16` policy."""
    return np64(built_under_keras_mixed_float16(family)(x))


def rule(model, layer_class):
    """The rule `precision_summary` gives for the (first) layer of a class."""
    return {r["class"]: r["rule"] for r in keras_mp.precision_summary(model).rows}[layer_class]


def keep_batchnorm(model, level):
    """At O3, BatchNorm in float32 where the model has it (its statistics)."""
    has_batchnorm = any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in model._flatten_layers(include_self=False)
    )
    return True if level == "O3" and has_batchnorm else None


# The steps' learning rate: a step moves each family's float32 loss by 0.02
# to 1.8, more than the levels' error on it. ConvNeXt's first step at 1e-2
# takes its loss from 1.1 to 1e-4, where float16's rounding is the step.
LEARNING_RATE = 1e-2
LEARNING_RATES = {"convnext": 1e-3}
# Adam's epsilon: at Keras's 1e-7, Adam's update `g / (|g| + epsilon)` is
# the same for a gradient and for 2**15 times it, so a step that applied the
# scaled gradients would pass. At 1e-3, most of these gradients' size, it
# would not.
EPSILON = 1e-3
# Three steps on the whole batch, one an epoch: their logged losses are the
# loss before each step, the last two after one and two updates.
STEPS = 3
# A level's loss at each step may be off float32's at the same step by at
# most this share of float32's smallest step: a step lost, doubled or taken
# in the wrong direction fails.
STEP_TOLERANCE = 0.5
# Steps skipped while the dynamic scale backs off from 2**15 (a few in
# float16 on a model at random init): the run goes on until STEPS applied.
MOST_SKIPPED = 8


def _adam(family):
    return keras.optimizers.Adam(LEARNING_RATES.get(family, LEARNING_RATE), epsilon=EPSILON)


class _UntilApplied(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 - int(logs.get("skipped_steps", 0)) >= STEPS:
            self.model.stop_training = True


def _compile_kwargs(family):
    return {"loss_weights": {"label": 1.0, "value": 0.5}} if family == "two_outputs" else {}


def steps(model, x, y, family):
    """`(losses, skipped)`: the loss of each step until STEPS are applied, and
    how many steps were skipped before each and in all."""
    fit_kwargs = {}
    if family == "two_outputs":
        fit_kwargs["sample_weight"] = np.linspace(0.5, 1.5, batch(x)).astype("float32")
    history = model.fit(
        x,
        y,
        batch_size=batch(x),
        epochs=STEPS + MOST_SKIPPED,
        shuffle=False,
        verbose=0,
        callbacks=[_UntilApplied()],
        **fit_kwargs,
    ).history
    losses = np.asarray(history["loss"], "float64")
    skipped = [0] + [int(s) for s in history.get("skipped_steps", [0] * len(losses))]
    return losses, skipped


_FLOAT32_STEPS = {}


def float32_steps(family):
    """The float32 model's losses over STEPS steps (once per family and
    process), compiled without keras_mp's keywords: eagerly on TensorFlow
    (cheaper than tracing its graph), as `fit` compiles it elsewhere."""
    if family not in _FLOAT32_STEPS:
        built, x, y, loss = model(family)
        built.compile(
            optimizer=_adam(family),
            loss=loss,
            run_eagerly=BACKEND == "tensorflow",
            **_compile_kwargs(family),
        )
        losses, _ = steps(built, x, y, family)
        assert len(losses) == STEPS and np.isfinite(losses).all(), (family, losses)
        _FLOAT32_STEPS[family] = losses
    return _FLOAT32_STEPS[family]


def compile_at(model, loss, level, half, family, **kwargs):
    """`compile(amp_level=level, amp_dtype=half)` with Adam at LEARNING_RATE."""
    if level == "O3" and half == "float16":
        # O3 has no loss scaling by default (Apex's speed baseline): with
        # float16 everywhere, CNNs at random init overflow (NaN under Keras's
        # own float16 policy too). Opting in skips those steps.
        kwargs.setdefault("loss_scale", "dynamic")
    model.compile(
        optimizer=_adam(family),
        loss=loss,
        amp_level=level,
        amp_dtype=half,
        keep_batchnorm_fp32=keep_batchnorm(model, level),
        **_compile_kwargs(family),
        **kwargs,
    )


def assert_follows(losses, skipped, reference, cell):
    """Each step's loss is float32's after as many applied steps, within
    STEP_TOLERANCE of float32's smallest step; STEPS steps were applied."""
    bound = STEP_TOLERANCE * np.min(np.abs(np.diff(reference)))
    detail = (cell, list(losses), list(reference), skipped)
    assert np.isfinite(losses).all(), detail
    assert len(losses) - skipped[-1] == STEPS, detail
    errors = [abs(loss - reference[epoch - skipped[epoch]]) for epoch, loss in enumerate(losses)]
    assert max(errors) <= bound, (max(errors), bound, detail)


def trains_as_float32_does(family, level, half, **kwargs):
    """The family compiled at `level` in `half` takes STEPS steps, each
    step's loss float32's (`assert_follows`): `(trained model, x, steps
    skipped)`."""
    reference = float32_steps(family)
    built, x, y, loss = model(family)
    compile_at(built, loss, level, half, family, **kwargs)
    losses, skipped = steps(built, x, y, family)
    assert_follows(losses, skipped, reference, (family, level, half))
    return built, x, skipped[-1]
