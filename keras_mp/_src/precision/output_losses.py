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


def kinds(loss, y_pred, output_names=None):
    """`{leaf: (loss name, whether a cross-entropy)}` for the leaves of
    `y_pred` that `compile`'s `loss` reaches, paired as Keras's
    `CompileLoss.build` pairs them: `y_pred` is the model's outputs as its
    call returns them, each output a distinct int (a dict's values in its
    sorted keys' order, as `keras.tree` flattens it); `output_names` the
    model's (a functional model's output layers' names, None for others).
    One loss reaches every output; a list is packed into the outputs'
    structure (a dict's outputs in sorted key order, not insertion order);
    a dict goes by output key, or by output name where the outputs are not
    a dict. Where Keras would refuse the pairing, {}. An output several
    losses reach is given the first that is not a cross-entropy."""
    found = {}
    try:
        _pair(loss, y_pred, output_names, found)
    except (TypeError, KeyError, ValueError):
        return {}
    kinds = {}
    for leaf, given in found.items():
        named = [_kind(each) for each in given]
        kinds[leaf] = next((k for k in named if not k[1]), named[0])
    return kinds


def _pair(loss, y_pred, output_names, found):
    """`CompileLoss.build` (Keras 3.15), with the outputs' leaves for its
    tensors: what it would raise, it raises."""
    tree = keras.tree
    if output_names and isinstance(loss, dict) and not isinstance(y_pred, dict):
        if set(output_names) != set(loss):
            raise ValueError(f"loss keys {list(loss)} are not the output names {output_names}")
        loss = [loss[name] for name in output_names]
    if isinstance(loss, dict) and isinstance(y_pred, (list, tuple)):
        if set(loss) == set(output_names) and len(y_pred) == len(output_names):
            y_pred = dict(zip(output_names, y_pred))
    elif isinstance(loss, dict) and not tree.is_nested(y_pred):
        if set(loss) == set(output_names) and len(output_names) == 1:
            y_pred = {output_names[0]: y_pred}
    if not tree.is_nested(loss):
        loss = tree.map_structure(lambda _: loss, y_pred)
    _pair_nested(loss, y_pred, found, unnamed=output_names is None)


def _pair_nested(loss, y_pred, found, unnamed=False):
    """`CompileLoss._build_nested`: `found[leaf]` gets each loss that
    reaches it. `unnamed`: at the outputs' root, with no output names."""
    tree = keras.tree
    if not tree.is_nested(loss):
        if loss is None:  # Keras reads `None.loss` here
            raise TypeError("no loss")
        if unnamed and isinstance(y_pred, (list, tuple)):  # Keras cannot name this loss
            raise TypeError("a loss of all the outputs, unnamed")
        for leaf in tree.flatten(y_pred):
            found.setdefault(leaf, []).append(loss)
        return
    sequence = isinstance(loss, (list, tuple))
    if (
        sequence
        and not any(tree.is_nested(each) for each in loss)
        and len(loss) == len(tree.flatten(y_pred))
    ):
        loss = tree.pack_sequence_as(y_pred, loss)
    elif sequence and not isinstance(y_pred, type(loss)):
        for each in loss:  # each loss on all the outputs
            _pair_nested(each, y_pred, found, unnamed)
        return
    if not tree.is_nested(loss):
        return _pair_nested(loss, y_pred, found, unnamed)
    if not isinstance(loss, type(y_pred)):
        raise KeyError("the loss's structure is not the outputs'")
    if isinstance(loss, dict):
        items, there = loss.items(), lambda key: key in y_pred
    elif isinstance(loss, (list, tuple)):
        items, there = enumerate(loss), lambda key: key < len(y_pred)
    else:
        raise TypeError(f"unsupported loss structure {type(loss).__name__}")
    for key, each in items:
        if each is None:
            continue
        if not there(key):
            raise KeyError(key)
        _pair_nested(each, y_pred[key], found)


def several(loss):
    """The `(name, whether a cross-entropy)` of each loss in `loss` (one, a
    list or a dict), the first a regression's where there is one: what a
    model whose outputs cannot be traced is given, [] for none."""
    given = [_kind(each) for each in keras.tree.flatten(loss) if each is not None]
    return sorted(given, key=lambda k: k[1])


def kind(loss):
    """A single loss's `(name, whether a cross-entropy)`, or None for
    several (a list or dict of them) or none."""
    return None if loss is None or keras.tree.is_nested(loss) else _kind(loss)


def _kind(loss):
    name = loss_name(loss)
    return name, name in CROSS_ENTROPIES


def describe(loss):
    """The loss as a rule's reason names it."""
    return f"loss {loss[0]}" if loss else "no loss keras_mp knows"
