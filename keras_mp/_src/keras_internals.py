"""Every use of Keras's internals, in one place.

keras_mp reaches into Keras where its public API has no door: the trainer
whose `compile` it extends, the functional model class, a tensor's Keras
mask, the autocast scope, a layer's direct children, a variable's dtype. The
next Keras release may move any of these; this module is the surface it can
break. A name that is missing fails `import keras_mp` with an error naming
the Keras version and the name, not an `AttributeError` deep in a step.

Private attributes of optimizers that keras_mp overrides (`update_step`,
`_apply_weight_decay`, an optimizer's own `_variables`) are the subclassing
surface of `keras.optimizers.Optimizer`, and stay with the code that
overrides them (`compensated.py`, `loss_scale_optimizer.py`).
"""

import contextlib
import importlib

import keras

# The Keras releases keras_mp is tested with: the whole suite on the newest,
# the smoke tests (`-m floor`) on the oldest, which pyproject.toml requires.
TESTED = "3.15"
OLDEST = (3, 10)


class KerasInternalsError(ImportError):
    """A Keras internal that keras_mp needs is missing in this Keras."""


class KerasTooOldError(ImportError):
    """The installed Keras is older than the oldest keras_mp supports."""


def _release(version):
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_keras_version(version=None):
    """Fails here, at import, on a Keras older than `OLDEST` (not later, in
    `fit`, where an older Keras lacks what a step uses)."""
    version = keras.__version__ if version is None else version
    if _release(version) < OLDEST:
        oldest = ".".join(map(str, OLDEST))
        raise KerasTooOldError(
            f"keras_mp needs Keras {oldest} or newer (tested with {oldest} and "
            f"{TESTED}); this environment has Keras {version}. Upgrade it: "
            f"`pip install -U 'keras>={oldest}'`."
        )


check_keras_version()


def _need(module, name):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise KerasInternalsError(
            f"keras_mp needs `{module}.{name}` from Keras's internals, which "
            f"Keras {keras.__version__} does not have (keras_mp is tested with "
            f"Keras {TESTED}). Install a Keras release keras_mp supports "
            f"(`pip install 'keras=={TESTED}.*'`), or a keras_mp release made "
            f"for Keras {keras.__version__}."
        ) from error


# Keras's `Trainer`: `compile`, `compile_from_config`, `get_compile_config`
# and `_aggregate_additional_loss` are extended on it (`compile.py`).
Trainer = _need("keras.src.trainers.trainer", "Trainer")
# Sequential and functional models: Keras casts each of their layers' inputs.
Functional = _need("keras.src.models.functional", "Functional")
get_keras_mask = _need("keras.src.backend", "get_keras_mask")
set_keras_mask = _need("keras.src.backend", "set_keras_mask")
# Reads a layer's float32 weights and inputs in another dtype (`fallback.py`).
AutocastScope = _need("keras.src.backend", "AutocastScope")
# Keras's own messages go through it (quiet under `keras.config.disable_interactive_logging`).
print_msg = _need("keras.src.utils.io_utils", "print_msg")
# The speed report: a symbolic forward pass, and the convolutions' bases.
_compute_output_spec = _need("keras.src.backend", "compute_output_spec")
_global_state = importlib.import_module("keras.src.backend.common.global_state")


def compute_output_spec(fn, *args, **kwargs):
    """Keras's symbolic pass, leaving Keras's name-scope stack as it found
    it. On TensorFlow the pass runs in a new graph, where a model whose name
    TensorFlow refuses as a root scope (`_MyModel` names itself
    `__my_model`) raises inside Keras's `name_scope.__enter__` after its
    entry was pushed: every variable made later in the process would be
    named under it. The pass runs `fn` under a scope of its own, so that
    the model's is never a root scope and the pass goes through."""

    def scoped(*args, **kwargs):
        with keras.name_scope("keras_mp_pass"):
            return fn(*args, **kwargs)

    stack = _global_state.get_global_attribute("name_scope_stack")
    depth = len(stack) if stack else 0
    try:
        return _compute_output_spec(scoped, *args, **kwargs)
    finally:
        stack = _global_state.get_global_attribute("name_scope_stack")
        if stack and len(stack) > depth:
            del stack[depth:]


BaseConv = _need("keras.src.layers.convolutional.base_conv", "BaseConv")
BaseConvTranspose = _need("keras.src.layers.convolutional.base_conv_transpose", "BaseConvTranspose")
BaseDepthwiseConv = _need("keras.src.layers.convolutional.base_depthwise_conv", "BaseDepthwiseConv")
BaseSeparableConv = _need("keras.src.layers.convolutional.base_separable_conv", "BaseSeparableConv")
no_automatic_dependency_tracking = _need(
    "keras.src.utils.tracking", "no_automatic_dependency_tracking"
)
LossFunctionWrapper = _need("keras.src.losses.losses", "LossFunctionWrapper")
get_input_signature = _need("keras.src.export.export_utils", "get_input_signature")
# `load_model`'s reading of a `.keras` file's config: keras_mp gives a model
# loaded with `compile=False` the precision its compile config recorded.
saving_lib = importlib.import_module("keras.src.saving.saving_lib")
_need("keras.src.saving.saving_lib", "_model_from_config")
# Optional: absent in a Keras that sums `add_loss` losses some other way,
# and then left alone.
aggregate_additional_loss = getattr(Trainer, "_aggregate_additional_loss", None)


def stateless_scope():
    """The active `keras.StatelessScope`, or None."""
    return _need("keras.src.backend.common.stateless_scope", "get_stateless_scope")()


_global_state = _need("keras.src.backend.common", "global_state")


def call_in_training():
    """Whether the layer call under way runs in training (Keras's call
    context, set by the outermost layer called); False outside a call."""
    context = _global_state.get_global_attribute("current_call_ctx")
    return bool(getattr(context, "training", None))


# Keras's probability operations, as a functional graph holds them
# (`ops.softmax`, `ops.log_softmax`, `ops.sigmoid`, and `keras.activations.*`
# on a Keras tensor), by the name of the function that makes them.
PROBABILITY_OPERATIONS = {
    "softmax": _need("keras.src.ops.nn", "Softmax"),
    "log_softmax": _need("keras.src.ops.nn", "LogSoftmax"),
    "sigmoid": _need("keras.src.ops.nn", "Sigmoid"),
}
# The backend's module of those functions: every Keras road to them (`ops`,
# `activations`, a graph's operations, the layers) calls them through it.
backend_nn = _need("keras.src", "backend").nn


def layer_scopes():
    """How many layers' name scopes are open (Keras's name-scope stack, this
    thread): each layer's `__call__` opens its own around its `call`."""
    stack = _global_state.get_global_attribute("name_scope_stack") or ()
    return sum(isinstance(getattr(s, "caller", None), keras.layers.Layer) for s in stack)


def children(layer):
    """The layers `layer` tracks directly (its sublayers, one level down)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def all_layers(layer):
    """`layer` and every layer inside it (Keras's own recursive walk)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def output_operations(model):
    """The operations (layers) that make a functional model's outputs; empty
    for a model that has none known (subclassed)."""
    outputs = getattr(model, "_outputs", None) or ()
    return [
        t._keras_history.operation
        for t in keras.tree.flatten(outputs)
        if getattr(t, "_keras_history", None) is not None
    ]


def consumed_operations(model):
    """Ids of a functional model's operations whose outputs another of its
    operations takes in (an intermediate output of a feature extractor)."""
    consumed = set()
    for nodes in (getattr(model, "_nodes_by_depth", None) or {}).values():
        for node in nodes:
            for parent in node.parent_nodes:
                consumed.add(id(parent.operation))
    return consumed


def graph_outputs(model):
    """A Sequential or functional model's output KerasTensors as its call
    returns them (a dict keeps its keys, a list of one is its tensor), or
    None (a Sequential never built on an input has no graph)."""
    if isinstance(model, keras.Sequential):
        model = getattr(model, "_functional", None)
    outputs = getattr(model, "_outputs_struct", None)
    single = isinstance(outputs, (list, tuple)) and len(outputs) == 1
    return outputs[0] if single else outputs  # as Keras's `unpack_singleton`


def made_by(tensor):
    """`(operation, output index, inputs, (args, kwargs))` of the call that
    made a KerasTensor, or None (a graph's input)."""
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    node = history.operation._inbound_nodes[history.node_index]
    call = (tuple(node.arguments.args), node.arguments.kwargs)
    return history.operation, history.tensor_index, node.input_tensors, call


def build_shapes(layer):
    """The shapes a layer was built on, by the names of `build`'s arguments."""
    return dict(getattr(layer, "_build_shapes_dict", None) or {})


@contextlib.contextmanager
def symbolic_calls(layer):
    """A scope for calling `layer`'s `call` on KerasTensors: each layer and
    Keras operation called inside records a node (`made_by` reads them). On
    exit those recorded on `layer` and the layers in it are removed: the
    functional API reads them (`layer.output`, a graph's node indices).
    Yields `consumed(operation)`: how many times calls inside took in its
    outputs (a call taking two of them: twice; 0 for none).
    Outside any name scope, it opens one of its own, as `compute_output_spec`
    does; inside a model's (its build), a layer it builds is named as the
    model's own call would name it."""
    counts = {
        id(each): (each, len(each._inbound_nodes), len(each._outbound_nodes))
        for each in all_layers(layer)
    }

    def consumed(operation):
        outbound = getattr(operation, "_outbound_nodes", ())  # not an operation: an input
        return len(outbound) - counts.get(id(operation), (0, 0, 0))[2]

    stack = _global_state.get_global_attribute("name_scope_stack")
    depth = len(stack) if stack else 0
    try:
        with keras.name_scope("keras_mp_pass") if depth == 0 else contextlib.nullcontext():
            yield consumed
    finally:
        for each, inbound, outbound in counts.values():
            del each._inbound_nodes[inbound:]
            del each._outbound_nodes[outbound:]
        stack = _global_state.get_global_attribute("name_scope_stack")
        if stack and len(stack) > depth:
            del stack[depth:]


def operations_from_inputs(model):
    """A functional model's operations from its inputs on, each with the
    operations whose outputs it takes in: `[(operation, [parents])]`, every
    operation after its parents (an input layer has none)."""
    found = []
    by_depth = getattr(model, "_nodes_by_depth", None) or {}
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            found.append((node.operation, [p.operation for p in node.parent_nodes]))
    return found


def attributes(layer):
    """A layer's attributes by name, its sublayers included (on PyTorch a
    layer is a `torch.nn.Module`, which keeps its sublayers in `_modules`)."""
    found = dict(getattr(layer, "_modules", None) or {})
    found.update(vars(layer))
    return found


def own_trainable_variables(layer):
    """The trainable variables `layer` created itself."""
    return list(layer._trainable_variables)


def has_state(layer):
    """Whether `layer` created state its forward may update: non-trainable
    variables, seed generators (Dropout), or sublayers that may."""
    return bool(layer._non_trainable_variables or getattr(layer, "_seed_generators", None)) or any(
        has_state(child) for child in children(layer)
    )


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


def record_in_compile_config(model, **settings):
    """Adds `settings` to the config `model.get_compile_config()` returns."""
    model._compile_config.config.update(**settings)


def call_takes_training(model):
    """Whether `model.call` has a `training` argument."""
    return model._call_has_training_arg


def built_input_shape(layer):
    """The input shape a layer was built on (one input), or None."""
    return (getattr(layer, "_build_shapes_dict", None) or {}).get("input_shape")


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


# The current backend's NumPy-like ops (`matmul`, `einsum`): the speed
# report's trace notes the matmuls a layer's own `call` runs through them.
backend_numpy = _need("keras.src", "backend").numpy
