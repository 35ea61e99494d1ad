"""Keras's trainer from inside: the methods keras_mp extends, the compile
config, and the state `fit` builds and passes its step."""

import keras

from keras_mp._src.keras_internals.required import _need

# Keras's `Trainer`: `compile`, `compile_from_config`, `get_compile_config`
# and `_aggregate_additional_loss` are extended on it (`compile.py`).
Trainer = _need("keras.src.trainers.trainer", "Trainer")

# Keras's own messages go through it (quiet under `keras.config.disable_interactive_logging`).
print_msg = _need("keras.src.utils.io_utils", "print_msg")

LossFunctionWrapper = _need("keras.src.losses.losses", "LossFunctionWrapper")

# Keras's loss reduction (`Loss.__call__`'s): sample weights, the logits'
# mask, and `reduction` (the chunked loss, `lm_loss.py`, reduces as Keras does).
reduce_weighted_values = _need("keras.src.losses.loss", "reduce_weighted_values")
# Its steps, for each token's share of the loss (`lm_loss.shares`).
apply_mask = _need("keras.src.losses.loss", "apply_mask")
squeeze_or_expand_to_same_rank = _need("keras.src.losses.loss", "squeeze_or_expand_to_same_rank")
scale_loss_for_distribution = _need("keras.src.losses.loss", "scale_loss_for_distribution")
standardize_reduction = _need("keras.src.losses.loss", "standardize_reduction")

# Optional: absent in a Keras that sums `add_loss` losses some other way,
# and then left alone.
aggregate_additional_loss = getattr(Trainer, "_aggregate_additional_loss", None)


def record_in_compile_config(model, **settings):
    """Adds `settings` to the config `model.get_compile_config()` returns."""
    model._compile_config.config.update(**settings)


def call_takes_training(model):
    """Whether `model.call` has a `training` argument."""
    return model._call_has_training_arg


def is_keras_train_step(train_step):
    """Whether a bound `train_step` is Keras's PyTorch trainer's own (not a
    model's override)."""
    from keras.src.backend.torch.trainer import TorchTrainer

    return getattr(train_step, "__func__", None) is TorchTrainer.train_step


def build_for_training(model, data):
    """Builds `model`, its optimizer and metrics for a batch `data` (`(x, y)`)
    as `fit` does before its first step, running nothing."""
    model._symbolic_build(data_batch=data)


def jax_training_state(model):
    """The state Keras's JAX `fit` passes its `train_step`: trainable,
    non-trainable, optimizer and metrics values."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )


def is_keras_own_train_step(model):
    """Whether `model`'s `train_step` is a Keras backend trainer's own (not
    a model's override)."""
    step = getattr(type(model), "train_step", None)
    return getattr(step, "__module__", "").startswith("keras.src.backend.")


def compile_loss(model):
    """The `CompileLoss` `compile` made (its `call` computes the loss)."""
    return model._compile_loss


def compile_metrics(model):
    """The `CompileMetrics` `compile` made, or None."""
    return model._compile_metrics


def compiled_metrics(model):
    """`[(metric, weighted)]`: each metric `compile` was given (built),
    whether from `weighted_metrics`."""
    found = []
    compiled = model._compile_metrics
    if compiled is None or not compiled.built:
        return found
    for weighted, lists in (
        (False, compiled._flat_metrics),
        (True, compiled._flat_weighted_metrics),
    ):
        for metrics in lists or ():
            found += [(m, weighted) for m in getattr(metrics, "metrics", None) or ()]
    return found


def single_loss_weight(compiled):
    """The `loss_weights` of a one-output model's `compile`, or None."""
    weights = compiled._user_loss_weights
    if weights is None:
        return None
    flat = keras.tree.flatten(weights)
    return flat[0] if len(flat) == 1 else None
