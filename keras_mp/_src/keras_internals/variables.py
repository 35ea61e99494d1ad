"""Variables from inside: the ones a layer created, a dtype changed in
place, their values and layouts, and PyTorch's registration of them."""

import keras

from keras_mp._src.keras_internals.required import _need

_in_tf_graph = _need("keras.src.utils.backend_utils", "in_tf_graph")


def own_trainable_variables(layer):
    """The trainable variables `layer` created itself."""
    return list(layer._trainable_variables)


def own_variables(layer):
    """The variables `layer` created itself (not its sublayers')."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def recast(variable, dtype):
    """Gives a Keras variable a new dtype in place (same object, its value cast).

    TensorFlow's backing `tf.Variable` is made with the Keras variable's
    `trainable` of the moment, and keeps it: a weight of a frozen layer
    recast then would stay out of every `GradientTape` once the layer is
    unfrozen (Keras's setter changes only its own flag). The new one takes
    the flag of the one it replaces, as the weight was created. A variable
    made in a stateless scope (a model built by `fit`'s symbolic pass) has
    no value yet: it is made in the new dtype when the scope ends.
    """
    if variable._value is None and getattr(variable, "_initializer", None) is not None:
        variable._dtype = dtype
        return
    value = keras.ops.cast(variable.value, dtype)
    variable._dtype = dtype
    created_trainable = getattr(variable._value, "trainable", None)  # a tf.Variable's
    if created_trainable is None or created_trainable == variable._trainable:
        variable._initialize(value)
        return
    trainable, variable._trainable = variable._trainable, created_trainable
    try:
        variable._initialize(value)
    finally:
        variable._trainable = trainable


def hold_values(variables):
    """Whether the variables hold values (inside JAX's `fit`, and after one
    that failed before its state came back, they hold None)."""
    return all(v._value is not None for v in variables)


def readable_now(variable):
    """Whether a variable's value can be read as numbers here: not one made
    in a stateless scope (a model built by `fit`'s symbolic pass: no value
    until the scope ends), nor read while TensorFlow traces a graph (a model
    built by its first step)."""
    return variable._value is not None and not _in_tf_graph()


def variable_layout(variable):
    """The `keras.distribution` layout a variable was given (JAX), or None."""
    return getattr(variable, "_layout", None)


def built_variables(optimizer):
    """The variables an optimizer was built on, in order."""
    return optimizer._trainable_variables


def retrack_torch_parameters(model):
    """PyTorch modules register parameters by object, in every ancestor.

    Every torch module under the model, not only its Keras layers: a
    Sequential keeps its parameters in a functional model of its own
    (`_functional`), which Keras's layer walk does not visit. Left stale,
    `zero_grad()` (which Keras's and the guides' PyTorch steps call) would
    clear the old parameters' gradients, and the new ones' would add up
    from step to step.
    """
    if not hasattr(model, "modules"):  # not a torch module: another backend
        return
    for module in model.modules():
        if hasattr(module, "_torch_params") and hasattr(module, "_track_variables"):
            module._track_variables()
