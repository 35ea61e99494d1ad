"""The strings in `allow`/`deny` name layers of the model: each must.

`allow` and `deny` (`amp_allow`/`amp_deny` in `compile`) take layer
classes, layers and layer names. A string is a layer's `name` (as
`model.get_layer` takes it), never a class's: `"Dense"` names a layer
called "Dense", `keras.layers.Dense` the class. A name that matches no
layer of the model's whole tree (nested models included) would change
nothing, silently: a misspelt `amp_deny=["bdy"]` left the layer in half.
So `apply` refuses it, naming the argument, the name and the layer names
nearest to it (`difflib.get_close_matches`); a string that is the class
name of layers in the model is told to pass the class itself. Classes and
layer objects are not checked: a class may be meant for layers a model
does not have (a shared list of the user's), and a layer object is what
it is.
"""

import difflib

import keras

from keras_mp._src.precision import layer_tree


def check_names(model, amp):
    """Raises `ValueError` for a string in `amp.allow`/`amp.deny` that names
    no layer of `model`'s tree."""
    layers = layer_tree.layers_in_order(model)
    names = [layer.name for layer in layers]
    known = set(names)
    for argument, entries in zip(amp.list_arguments, (amp.allow, amp.deny)):
        for entry in entries:
            if isinstance(entry, str) and entry not in known:
                raise ValueError(_message(argument, entries, entry, names, layers))


def _class_path(cls):
    """How the user writes the class: `keras.layers.Dense`, or its name."""
    if getattr(keras.layers, cls.__name__, None) is cls:
        return f"keras.layers.{cls.__name__}"
    return cls.__qualname__


def _message(argument, entries, name, names, layers):
    received = f"Received: {argument}={list(entries)!r}"
    classes = [type(layer) for layer in layers if type(layer).__name__ == name]
    if classes:
        return (
            f"`{argument}` takes layer names, classes and layers, and no layer "
            f"of the model is named {name!r}: {name!r} is the name of a class. "
            f"To name the class, pass it: {argument}=[{_class_path(classes[0])}]. " + received
        )
    nearest = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    nearest += [n for n in names if n.lower() == name.lower() and n not in nearest]
    hint = (
        "The nearest layer names: " + ", ".join(repr(n) for n in nearest) + "."
        if nearest
        else "Its layers are named: "
        + ", ".join(repr(n) for n in names[:20])
        + (", ..." if len(names) > 20 else "")
        + "."
    )
    return (
        f"`{argument}` names no layer of the model: {name!r} is not the name "
        f"of any layer in it (nested models included), so it would change "
        f"nothing. {hint} A string names a layer (`layer.name`); pass a class "
        f"or a layer object to name those. " + received
    )
