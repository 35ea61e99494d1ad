"""Each layer's precision in the model's own config: every road back to a
model computes as the model did.

keras_mp sets more than a layer's Keras config holds: the policy of a layer
that config does not hold (a MultiHeadAttention's softmax, the layers of a
subclassed model or of a block of yours), the casts at a layer's boundary,
a probability computed in float32, the rule that decided. Keras rebuilds a
model from configs on several roads (`load_model`, `from_config(
get_config())`, `clone_model`, `model_from_json`), and the compile config
(`saved_precision.py`) reaches only those that compile the model. So every
model whose layers keras_mp set the precision of writes it in its own config,
as its `dtype`: a `keras_mp.AmpPolicy` of the model's policy name carrying
the record (`saved_precision.precision_record`; Keras's `get_config` of
`Model`, `Functional` and `Sequential`, extended). A model saved on its own
after its parent's level was set (an encoder) carries its own.

The rebuilt model is given it back, by position
(`saved_precision.restore_precision`):

- Sequential and functional models rebuilt from their config
  (`Model.from_config`, `Sequential.from_config`): once Keras has rebuilt
  them;
- subclassed models, whose sublayers Keras makes or builds later: once the
  model is built (its `build`, or `build_from_config` at `load_model` and
  `clone_model`). A `from_config` of the model's own class that passes the
  config to its constructor gets there too: the record rides in the policy;
- `clone_model` of a Sequential or functional model, whose layers Keras
  clones one by one without the model's config: the model's own record.

A record that does not fit the model rebuilt (a `clone_function` that
changes its layers) is not applied, with a warning that says so. Files of
earlier releases carry the record in their compile config only, which
`saved_precision.py` still gives back. KerasHub's backbones and tasks
write their configs without Keras's and rebuild through their own
constructors: their `dtype` is the one they were built under
(`loadable_config`), carrying the record, which the constructor gives
back (`_written_for_its_constructor`).
"""

import functools
import inspect
import warnings

import keras

from keras_mp._src import keras_internals
from keras_mp._src.model import saved_precision
from keras_mp._src.precision import layer_policy
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import loadable_config
from keras_mp._src.precision import policies
from keras_mp._src.precision.loadable_config import AmpPolicy
from keras_mp._src.precision.loadable_config import record_in
from keras_mp._src.precision.loadable_config import with_record
from keras_mp._src.precision.loadable_config import without_record

Functional = keras_internals.Functional
Layer = keras_internals.Layer
# A rebuilt model whose layers do not all exist yet: (record, road).
_PENDING = "_keras_mp_pending_precision"
_INSTALLED = "_keras_mp_config_precision"


def record_of(model):
    """The record of `model`'s layers' precision for its config; None where
    keras_mp set no layer's, or where Keras's configs alone rebuild what it
    set (every layer in float32 and nothing cast: O0)."""
    layers = layer_tree.layers_in_order(model)
    if all(layer_policy.rule_of(layer) == layer_policy.KERAS_DEFAULT_RULE for layer in layers):
        return None
    if not any(
        policies.needs_keras_mp(layer)
        or layer.compute_dtype != "float32"
        or layer.variable_dtype != "float32"
        for layer in layers
    ):
        return None
    return saved_precision.precision_record(model)


def _writing_the_record(get_config):
    # Keras's config; for a model whose layers keras_mp set the precision
    # of, the record of it as the model's `dtype`.
    @functools.wraps(get_config)
    def get_config_with_precision(self):
        config = get_config(self)
        if (
            not isinstance(config, dict)
            or type(self.dtype_policy) not in (keras.DTypePolicy, AmpPolicy)
            or not ("dtype" in config or layer_tree.is_graph(self))
        ):
            # A config without a `dtype` rebuilds through a constructor
            # that may not take one; a quantized policy is left whole.
            return config
        if record_in(config) is not None:
            return config  # a record already: not given back yet, or written by Model's
        record = record_of(self)
        if record is None:
            return config
        return with_record(config, record, self.dtype_policy.name)

    setattr(get_config_with_precision, _INSTALLED, True)
    return get_config_with_precision


def give_back(model, record, road):
    """Gives `model` the precision `record` holds; where its layers do not
    all exist yet (a subclassed model not built), once it is built."""
    if saved_precision.restore_precision(model, record):
        return
    if not model.built:
        object.__setattr__(model, _PENDING, (record, road))
        return
    warnings.warn(
        f"keras_mp: {road} rebuilt model {model.name!r}, whose config records "
        f"the precision keras_mp set for its {len(record)} layers; the model "
        f"rebuilt has other layers (in number or class), so that precision was "
        f"not given back and its layers compute as their Keras configs say. "
        f"Set it again (`keras_mp.apply_amp(model, ...)`, or "
        f"`compile(..., amp_level=...)`).",
        stacklevel=3,
    )


def _give_back_pending(layer, policy=None):
    """A built model's pending record: set by `give_back`, or in its policy
    (`policy`, else the model's) where a `from_config` of its own class
    passed the record to its constructor."""
    pending = layer.__dict__.pop(_PENDING, None)
    if pending is None:
        policy = layer.dtype_policy if policy is None else policy
        record = getattr(policy, "layers", None) if isinstance(policy, AmpPolicy) else None
        if not record or record[0].get("class") != type(layer).__name__:
            return  # none, or the model's own passed on to a sublayer
        policy.layers = None  # given back once
        pending = (record, f"{type(layer).__name__}.from_config")
    give_back(layer, *pending)


def _given_back_once_built(method):
    @functools.wraps(method)
    def and_precision_given_back(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        _give_back_pending(self)
        return result

    setattr(and_precision_given_back, _INSTALLED, True)
    return and_precision_given_back


def _given_back_once_its_graph_is_built(init):
    # Keras's functional constructor, which drops the `dtype` it is given; a
    # record in it (a KerasHub task's config) is given back once the graph
    # is built.
    @functools.wraps(init)
    def init_and_precision_given_back(self, *args, **kwargs):
        init(self, *args, **kwargs)
        dtype = kwargs.get("dtype")
        if isinstance(dtype, dict) and dtype.get("class_name") == AmpPolicy.__name__:
            dtype = keras.dtype_policies.deserialize(dtype)
        if isinstance(dtype, AmpPolicy) and dtype.layers:
            _give_back_pending(self, dtype)

    # As Keras reads it (`Model.from_config` compares its arguments).
    init_and_precision_given_back.__signature__ = inspect.signature(init)
    setattr(init_and_precision_given_back, _INSTALLED, True)
    return init_and_precision_given_back


def _reading_the_record(from_config):
    # Keras's `from_config`; the model is given back the precision its
    # config records.
    @functools.wraps(from_config)
    def from_config_with_precision(cls, config, custom_objects=None):
        config, record = without_record(config)
        model = from_config(cls, config, custom_objects=custom_objects)
        if record is not None:
            give_back(model, record, f"{cls.__name__}.from_config")
        return model

    setattr(from_config_with_precision, _INSTALLED, True)
    return classmethod(from_config_with_precision)


def _written_for_its_constructor(model, config, built_under):
    """The config of a model that its own constructor builds (KerasHub's
    backbones and tasks), with the record of its layers' precision in its
    `dtype`, which that constructor takes: a task's config has none, and
    its constructor passes `dtype` on to Keras's. The constructor gives it
    back: Keras's functional one once it has built the graph
    (`Functional.__init__`), or a backbone's where it sets the model's
    policy after (`_given_back_when_set`)."""
    record = record_of(model)
    if record is None:
        return config
    if not ("dtype" in config or _takes_a_dtype(type(model))):
        _say_the_config_cannot_carry(model, record)
        return config
    return with_record(config, record, built_under.name)


_TOLD = "_keras_mp_told_config_cannot_carry"


def _say_the_config_cannot_carry(model, record):
    # Once a model: its config is read at each save and clone.
    if model.__dict__.get(_TOLD):
        return
    object.__setattr__(model, _TOLD, True)
    name = type(model).__name__
    warnings.warn(
        f"keras_mp: the config of model {model.name!r} cannot carry the "
        f"precision keras_mp set for its {len(record)} layers: "
        f"`{name}.get_config` gives no `dtype` and `{name}.__init__` takes "
        f"none. Rebuilt from this config alone (`from_config`, `clone_model`, "
        f"`load_model` of a model not compiled with `amp_level`), it computes "
        f"as its Keras configs say. Take `**kwargs` in `{name}.__init__` and "
        f"pass them to `super().__init__`, or set the precision again on the "
        f"model rebuilt (`keras_mp.apply_amp`).",
        stacklevel=4,  # the caller of `get_config`
    )


def _takes_a_dtype(cls):
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "dtype" or p.kind is p.VAR_KEYWORD for p in parameters)


def _given_back_when_set(dtype_policy):
    # Keras's `Layer.dtype_policy`; a record set as the policy of a model
    # already built is given back, as Keras quantizes a built layer whose
    # policy is set to a quantized one.
    def set_dtype_policy(self, value):
        dtype_policy.fset(self, value)
        policy = self.dtype_policy
        if self.built and isinstance(policy, AmpPolicy) and policy.layers:
            _give_back_pending(self)

    setattr(set_dtype_policy, _INSTALLED, True)
    return property(dtype_policy.fget, set_dtype_policy, doc=dtype_policy.__doc__)


def _cloning_the_precision(clone):
    # Keras's clone of a Sequential or functional model, layer by layer;
    # the clone is given the precision of the model.
    @functools.wraps(clone)
    def clone_with_precision(model, *args, **kwargs):
        copy = clone(model, *args, **kwargs)
        record = record_of(model)
        if record is not None:
            give_back(copy, record, "keras.models.clone_model")
        return copy

    setattr(clone_with_precision, _INSTALLED, True)
    return clone_with_precision


def _install(owner, name, make, *, class_method=False):
    current = getattr(owner, name)
    if getattr(current, _INSTALLED, False):
        return
    if class_method:
        current = owner.__dict__[name].__func__
    setattr(owner, name, make(current))


def install():
    """Installs the record's writing and reading (idempotent)."""
    for cls in (keras.Model, Functional, keras.Sequential):
        _install(cls, "get_config", _writing_the_record)
    for cls in (keras.Model, keras.Sequential):
        _install(cls, "from_config", _reading_the_record, class_method=True)
    _install(keras.Model, "build_from_config", _given_back_once_built)
    _install(Functional, "__init__", _given_back_once_its_graph_is_built)
    _install(Layer, keras_internals.POST_BUILD, _given_back_once_built)
    for name in keras_internals.CLONES:
        _install(keras_internals.cloning, name, _cloning_the_precision)
    if not getattr(Layer.dtype_policy.fset, _INSTALLED, False):
        Layer.dtype_policy = _given_back_when_set(Layer.dtype_policy)
    if _written_for_its_constructor not in loadable_config._record_writers:
        loadable_config._record_writers.append(_written_for_its_constructor)
