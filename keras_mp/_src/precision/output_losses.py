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

from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree

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


def keyed_outputs(model, outputs):
    """`[(key, layer)]`: the layers that make the model's outputs, in the
    order of `model.outputs` (those other layers also take in included), a
    dict output's key beside each (None otherwise). `outputs`: the model's
    output layers as `layer_tree.output_layers` finds them, used where the
    model's own outputs are not known (a subclassed model)."""
    structure = keras_internals.output_structure(model)
    if isinstance(model, keras.Sequential):
        last = model.layers[-1:]
        if last and isinstance(last[0], keras.Model):  # a nested model's outputs
            return keyed_outputs(last[0], layer_tree.output_layers(last[0]))
        return [(None, layer) for layer in last]
    if structure is None:
        return [(None, layer) for layer in outputs]
    items = structure.items() if isinstance(structure, dict) else [(None, structure)]
    keyed = []
    for key, value in items:
        for tensor in keras.tree.flatten(value):
            history = getattr(tensor, "_keras_history", None)
            if history is None:
                continue
            layer = history.operation
            if isinstance(layer, keras.Model):  # a nested model's outputs
                keyed += [(key, inner) for _, inner in keyed_outputs(layer, ())]
            elif not isinstance(layer, keras.layers.Layer):  # `ops.squeeze(dense(x))`
                keyed += [(key, inner) for inner in layer_tree.layers_before(model, layer)]
            else:
                keyed.append((key, layer))
    return keyed


def of_outputs(keyed, loss):
    """`{id(output layer): (loss name, whether it is a cross-entropy)}` for
    the layers of `keyed` (`keyed_outputs`) whose loss `compile`'s `loss`
    names: one loss for every output, a list in the model's output order, or
    a dict by output key (or layer name); outputs without a loss keras_mp can
    tell are left out."""
    if loss is None or not keyed:
        return {}
    if isinstance(loss, dict):
        found = {}
        for key, layer in keyed:
            given = loss.get(key) if key in loss else loss.get(layer.name)
            if given is not None:
                found[id(layer)] = _kind(given)
        return found
    if isinstance(loss, (list, tuple)):
        if len(loss) != len(keyed):
            return {}
        return {id(layer): _kind(v) for (_, layer), v in zip(keyed, loss) if v is not None}
    return {id(layer): _kind(loss) for _, layer in keyed}


def _kind(loss):
    name = loss_name(loss)
    return name, name in CROSS_ENTROPIES


def describe(loss):
    """The loss as a rule's reason names it."""
    return f"loss {loss[0]}" if loss else "no loss keras_mp knows"
