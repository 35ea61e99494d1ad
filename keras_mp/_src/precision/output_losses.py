"""What each model output's loss says about its values: the head rule.

A model's output layers compute in half (a language model's logits matmul
is often the step's largest) and return float32. In float16 that is safe
only where the outputs stay far inside float16's range (65504): logits or
probabilities read by a cross-entropy, or an output that a bounded
activation of its own (sigmoid, tanh, softmax) keeps in range. A
regression's outputs are its targets' scale (house prices, pixel noise):
in float16 they overflow to inf, and a loss like MAE has a finite gradient
there, so the steps are applied, not skipped. Such an output layer, and one
whose loss keras_mp does not know (a function of the user's, or none given
to `apply_amp`), computes in float32 at float16 levels; bfloat16, with
float32's range, keeps every head in half (`rules.py`).
"""

import keras

# Losses that read logits or probabilities (or ±1 margins): their output
# layer's values are bounded by what the loss trains them to be.
CROSS_ENTROPIES = frozenset(
    {
        "categorical_crossentropy",
        "sparse_categorical_crossentropy",
        "binary_crossentropy",
        "binary_focal_crossentropy",
        "categorical_focal_crossentropy",
        "kl_divergence",
        "hinge",
        "squared_hinge",
        "categorical_hinge",
        "ctc",
    }
)


def loss_name(loss):
    """The name of a loss given to `compile` (a string, a Keras loss, a
    function), as Keras names its functions, or None."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except (ValueError, TypeError):
            return loss
    fn = getattr(loss, "fn", None)  # Keras's Loss classes wrap a function
    return getattr(fn or loss, "__name__", None) or type(loss).__name__


def of_outputs(model, outputs, loss):
    """`{id(output layer): (loss name, whether it is a cross-entropy)}` for
    the layers in `outputs` whose loss `compile`'s `loss` names (one loss for
    every output, a list in the model's output order, or a dict by output
    name); outputs without a loss keras_mp can tell are left out."""
    if loss is None or not outputs:
        return {}
    if isinstance(loss, dict):
        names = list(getattr(model, "output_names", None) or ())
        by_layer = {}
        for index, layer in enumerate(outputs):
            key = layer.name if layer.name in loss else None
            if key is None and index < len(names) and names[index] in loss:
                key = names[index]
            if key is not None:
                by_layer[id(layer)] = loss[key]
        return {k: _kind(v) for k, v in by_layer.items() if v is not None}
    if isinstance(loss, (list, tuple)):
        if len(loss) != len(outputs):
            return {}
        return {id(layer): _kind(v) for layer, v in zip(outputs, loss) if v is not None}
    return {id(layer): _kind(loss) for layer in outputs}


def _kind(loss):
    name = loss_name(loss)
    return name, name in CROSS_ENTROPIES


def describe(loss):
    """The loss as a rule's reason names it."""
    return f"loss {loss[0]}" if loss else "no loss keras_mp knows"
