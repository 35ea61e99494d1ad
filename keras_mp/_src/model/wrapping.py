"""Which optimizers a model trains with, and wrapping each in what its
precision needs: no bare optimizer under a half-precision model.

`compile(amp_level=...)` wraps the optimizer it is given. A model whose
precision keras_mp set (`apply_amp`, `to_float`) may be compiled by code of
its own instead: a `compile(d_optimizer, g_optimizer, loss_fn)` that keeps
its optimizers in attributes of its own (keras-io's DCGAN), or in a list or
a dict. Before the first `fit` (or `train_on_batch`), every optimizer the
model holds that way is wrapped in a `LossScaleOptimizer` that gives what
the layers' policies need (`needs`):

- a dynamic loss scale where a layer computes in float16 with float32
  variables (O1, O2, `to_float("float16")`): float16 gradients underflow;
- float32 master copies where variables are half (O3): without them Adam's
  update of a bfloat16 weight rounds to nothing;
- everywhere else in half (bfloat16, O3 in float16), a fixed scale of 1 that
  checks each step and skips a non-finite one, with nothing lost.

The attribute then holds the wrapper (what `self.d_optimizer` gives the
model's own `train_step`), and keras_mp says once which it wrapped.
"""

import typing
import warnings

import keras

from keras_mp._src import keras_internals
from keras_mp._src.optimizer.inner_optimizer import clip_in_float32
from keras_mp._src.optimizer.inner_optimizer import wrapper_of
from keras_mp._src.optimizer.loss_scale_optimizer import LossScaleOptimizer
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.levels import HALF_DTYPES

# On a model: the optimizers keras_mp wrapped, as (label, description).
_WRAPPED = "_keras_mp_wrapped_optimizers"
# On a model: `compile(..., auto_scale_loss=False)` (its optimizers are left bare).
_LEFT_BARE = "_keras_mp_left_bare"


def wrap_optimizer(
    optimizer, loss_scale, half_variables, master_weights, shard_optimizer_state=False
):
    """The optimizer a model trains with, under the amp settings.

    `master_weights` (None: True) matters where the level makes variables half
    (`half_variables`, O3): without a loss scale, the optimizer is wrapped all
    the same, in a fixed scale of 1, for the float32 copies (and the skip of a
    non-finite step that comes with the wrapper). So it is for
    `shard_optimizer_state=True`, which the wrapper carries out (`zero.py`).
    """
    masters = True if master_weights is None else master_weights
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if isinstance(optimizer, LossScaleOptimizer):
            converted = optimizer  # an explicit LossScaleOptimizer is kept as given
        else:
            converted = _from_keras_loss_scale_optimizer(optimizer, masters)
        if master_weights is not None and converted.master_weights != master_weights:
            raise ValueError(
                "`master_weights` and the LossScaleOptimizer passed as "
                "`optimizer` disagree; set it on one of them. Received: "
                f"master_weights={master_weights!r}, "
                f"optimizer.master_weights={converted.master_weights!r}"
            )
        if shard_optimizer_state and not converted.shard_optimizer_state:
            raise ValueError(
                "`shard_optimizer_state` and the LossScaleOptimizer passed as "
                "`optimizer` disagree; set it on one of them. Received: "
                "shard_optimizer_state=True, optimizer.shard_optimizer_state=False"
            )
        return converted
    if loss_scale is None and not (half_variables and masters) and not shard_optimizer_state:
        return optimizer
    if loss_scale is None:
        loss_scale = 1.0  # the wrapper for the master weights only
    dynamic = loss_scale == "dynamic"
    wrapper = wrapper_of(optimizer)
    if _fits(wrapper, loss_scale, masters, shard_optimizer_state):
        # The same optimizer compiled again (a second `compile` call): its
        # wrapper, with its state, rather than a second one around it.
        return wrapper
    if dynamic:
        return LossScaleOptimizer(
            optimizer,
            master_weights=masters,
            shard_optimizer_state=shard_optimizer_state,
            name="loss_scale_optimizer",
        )
    return LossScaleOptimizer(
        optimizer,
        dynamic=False,
        initial_scale=float(loss_scale),
        master_weights=masters,
        shard_optimizer_state=shard_optimizer_state,
        name="loss_scale_optimizer",
    )


def _fits(wrapper, loss_scale, masters, shard_optimizer_state):
    dynamic = loss_scale == "dynamic"
    return (
        wrapper is not None
        and wrapper.dynamic == dynamic
        and (dynamic or wrapper.initial_scale == float(loss_scale))
        and wrapper.master_weights == masters
        and wrapper.shard_optimizer_state == shard_optimizer_state
    )


def wrapped_otherwise(
    optimizer, loss_scale, half_variables, master_weights, shard_optimizer_state=False
):
    """Whether `optimizer` is the inner optimizer of a live LossScaleOptimizer
    that `wrap_optimizer` (same arguments) would not return: a wrapper of
    other settings (which refuses to wrap it a second time), or none."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    wrapper = wrapper_of(optimizer)
    if wrapper is None:
        return False
    masters = True if master_weights is None else master_weights
    if loss_scale is None and not (half_variables and masters) and not shard_optimizer_state:
        return True  # bare now
    return not _fits(
        wrapper, 1.0 if loss_scale is None else loss_scale, masters, shard_optimizer_state
    )


def _from_keras_loss_scale_optimizer(optimizer, master_weights):
    """Keras's own LossScaleOptimizer, as keras_mp's: same settings and state.

    Under `amp_level` a skipped step must also leave BatchNorm's statistics
    and the metrics as they were, and the logs carry the scale; both need
    keras_mp's optimizer. Neither scale has a floor (`min_scale=None`); one
    that Keras's let fall to 0 comes back as 2**-126, keras_mp's lowest.
    """
    initial_scale = float(optimizer.initial_scale)
    converted = LossScaleOptimizer(
        optimizer.inner_optimizer,
        initial_scale=initial_scale,
        dynamic_growth_steps=optimizer.dynamic_growth_steps,
        max_scale=max(2.0**24, initial_scale),
        master_weights=master_weights,
        name=optimizer.name,
    )
    if optimizer.built:
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
        converted.loss_scale.assign(min(max(scale, converted.config.floor), converted.max_scale))
        converted.good_steps.assign(optimizer.step_counter.value)
    warnings.warn(
        "compile(amp_level=...) replaced keras.optimizers.LossScaleOptimizer "
        "with keras_mp.LossScaleOptimizer (same inner optimizer, settings and "
        "scale), so that a skipped step loses nothing and the scale is "
        "logged; use `model.optimizer` from now on.",
        stacklevel=5,
    )
    return converted


def needs(model):
    """The loss scale the model's optimizers need, from its layers' policies.

    `"dynamic"` where a layer computes in float16 with float32 variables
    (`mixed_float16`, as Keras's `auto_scale_loss` decides); `1.0` (a fixed
    scale that checks each step) where layers compute in half otherwise
    (bfloat16; O3's pure half policies); None where nothing computes in half.
    """
    policies = [layer.dtype_policy for layer in layer_tree.layers_in_order(model)]
    if not any(keras.backend.standardize_dtype(p.compute_dtype) in HALF_DTYPES for p in policies):
        return None
    if any(p.name == "mixed_float16" for p in policies):
        return "dynamic"
    return 1.0


def has_half_variables(model):
    """Whether a layer of `model` keeps its variables in half (O3)."""
    return any(
        keras.backend.standardize_dtype(layer.dtype_policy.variable_dtype) in HALF_DTYPES
        for layer in layer_tree.layers_in_order(model)
    )


class Held(typing.NamedTuple):
    """An optimizer a model holds, and where.

    `label` names it in logs and messages (`d_optimizer`, or
    `ff_dense.optimizer` for a layer's own); `holder` is the model or layer
    whose attribute `attribute` holds it (`self.optimizer` in that layer's
    code); `setter(new)` puts `new` in its place.
    """

    label: str
    setter: typing.Callable
    optimizer: object
    holder: object
    attribute: str


def find_optimizers(model):
    """The optimizers `model` holds, as `Held`s, each once, `optimizer` first.

    In its attributes (`optimizer`, `d_optimizer`), in lists, tuples and
    dicts held in them (`optimizers[1]`, `optimizers['generator']`), and the
    same in every layer and nested model of its tree: a layer that steps its
    own optimizer (keras-io's Forward-Forward `FFDense`) is labelled
    `<layer name>.<attribute>`. Keras's own layer classes (`Dense`,
    `BatchNormalization`: not a subclass of the user's, not a model) hold
    none and are passed over: every `train_on_batch` asks.
    """
    found, seen = [], set()
    holders = layer_tree.layers_in_order(model) if isinstance(model, keras.Layer) else [model]
    for holder in holders:
        if holder is not model and keras_internals.is_keras_layer_class(holder):
            continue
        prefix = "" if holder is model else f"{holder.name}."
        for held in _held_by(holder, prefix):
            if id(held.optimizer) not in seen:
                seen.add(id(held.optimizer))
                found.append(held)
    return found


_MAY_HOLD = (keras.optimizers.Optimizer, list, tuple, dict)


def _held_by(holder, prefix):
    """The optimizers among `holder`'s own attributes (not its layers')."""
    # Only the attributes that can hold one, `optimizer` first, then by name
    # (every `train_on_batch` asks: a model has a hundred attributes).
    attributes = {
        name: value
        for name, value in vars(holder).items()
        if isinstance(value, _MAY_HOLD) and not name.startswith("_")
    }
    names = sorted(attributes, key=lambda name: (name != "optimizer", name))
    for name in names:
        value = attributes[name]

        def set_attribute(new, name=name):
            setattr(holder, name, new)

        if isinstance(value, keras.optimizers.Optimizer):
            yield Held(prefix + name, set_attribute, value, holder, name)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):

                def set_item(new, name=name, i=i):
                    items = getattr(holder, name)
                    if isinstance(items, tuple):
                        setattr(holder, name, items[:i] + (new,) + items[i + 1 :])
                    else:
                        items[i] = new

                if isinstance(item, keras.optimizers.Optimizer):
                    yield Held(f"{prefix}{name}[{i}]", set_item, item, holder, f"{name}[{i}]")
        elif isinstance(value, dict):
            for key, item in value.items():

                def set_value(new, name=name, key=key):
                    getattr(holder, name)[key] = new

                if isinstance(item, keras.optimizers.Optimizer):
                    yield Held(
                        f"{prefix}{name}[{key!r}]", set_value, item, holder, f"{name}[{key!r}]"
                    )


def loss_scale_optimizers(model):
    """`(label, optimizer)` for each keras_mp LossScaleOptimizer `model` holds."""
    return [
        (held.label, held.optimizer)
        for held in find_optimizers(model)
        if isinstance(held.optimizer, LossScaleOptimizer)
    ]


def leave_bare(model, bare=True):
    """`compile(..., auto_scale_loss=False)`: the model's optimizers are not wrapped."""
    object.__setattr__(model, _LEFT_BARE, bare)


def wrap_model_optimizers(model):
    """Wraps each bare optimizer `model` holds in what its precision needs.

    An optimizer held by a layer or a nested model gets what that layer's
    own policies need (the skip alone where it computes all in float32
    inside a half model). Returns the labels of those it wrapped now (and says
    so, once per model). An optimizer already built (it has trained) is left
    as it is, with a warning: its slots belong to the variables it was built
    on; a nested model's own compiled optimizer that has trained (a
    distiller's teacher) is that model's business, and left silently.
    """
    if getattr(model, _LEFT_BARE, False):
        return []
    bare = []
    for held in find_optimizers(model):
        if isinstance(held.optimizer, LossScaleOptimizer):
            name_in_logs(held)
        elif not (held.optimizer.built and _compiled_by_a_nested_model(held, model)):
            bare.append(held)
    if not bare:  # every `fit` asks: the layer walks only where one is bare
        return []
    wrapped = []
    for held in bare:
        loss_scale = _needs_of_held(held, model)
        if loss_scale is None:
            continue
        optimizer = held.optimizer
        if optimizer.built:
            warnings.warn(
                f"keras_mp: `{held.label}` ({type(optimizer).__name__}) has already "
                f"trained, so it was not wrapped in a LossScaleOptimizer: the "
                f"model computes in half, and this optimizer has no loss scale, "
                f"no float32 master weights and no skip of a non-finite step. "
                f"Set its precision before its first step.",
                stacklevel=4,
            )
            continue
        half = has_half_variables(held.holder)
        wrapper = wrap_optimizer(optimizer, loss_scale, half_variables=True, master_weights=None)
        clip_in_float32(wrapper.inner_optimizer)
        held.setter(wrapper)
        name_in_logs(held._replace(optimizer=wrapper))
        wrapped.append((held.label, f"{type(optimizer).__name__}, {describe(wrapper, half)}"))
    if wrapped:
        object.__setattr__(model, _WRAPPED, list(getattr(model, _WRAPPED, [])) + wrapped)
        keras_internals.print_msg(
            "keras_mp: wrapped "
            + "; ".join(f"`{label}` ({text})" for label, text in wrapped)
            + " in keras_mp.LossScaleOptimizer, as the model's precision needs."
        )
    return [label for label, _ in wrapped]


def _needs_of_held(held, model):
    """The loss scale `held`'s optimizer needs: its holder's (`needs`), and
    where the holder computes nothing in half but the model does (a layer
    the head rule keeps float32, as Forward-Forward's last `FFDense` at O1
    float16), the skip of a non-finite step without a scale (1.0): its
    gradients are float32, but its inputs come from half layers, and a
    NaN batch another optimizer skips must not reach this one's weights."""
    loss_scale = needs(held.holder)
    if loss_scale is None and held.holder is not model and needs(model) is not None:
        return 1.0
    return loss_scale


def name_in_logs(held):
    """Tells a LossScaleOptimizer where it is held: its label in the logs,
    and the line a message asks for (`self.<attribute>` in its holder's code)."""
    optimizer = held.optimizer
    where = {
        "_keras_mp_label": held.label,
        "_keras_mp_code": f"self.{held.attribute}",
        "_keras_mp_holder": (
            ""
            if "." not in held.label
            else f" (in {type(held.holder).__name__} `{held.holder.name}`)"
        ),
    }
    for name, value in where.items():
        if getattr(optimizer, name, None) != value:  # (every `train_on_batch` asks)
            setattr(optimizer, name, value)


def _compiled_by_a_nested_model(held, model):
    return (
        held.holder is not model
        and isinstance(held.holder, keras.Model)
        and (held.attribute == "optimizer")
    )


def describe(optimizer, half_variables=True):
    """A LossScaleOptimizer's settings in words: its scale, skip and copies
    (the copies where the model has half variables)."""
    if optimizer.dynamic:
        scale = "dynamic loss scale"
    elif optimizer.initial_scale == 1.0:
        scale = "no loss scale"
    else:
        scale = f"fixed loss scale {optimizer.initial_scale:g}"
    parts = [scale]
    if optimizer.config.checks_finite:
        parts.append("non-finite steps skipped")
    if half_variables and optimizer.master_weights is True:
        parts.append("float32 master weights for half variables")
    elif half_variables and optimizer.master_weights:
        parts.append("compensated bfloat16 updates")
    moments = getattr(optimizer, "moment_dtypes", None)
    if moments:
        parts.append(f"Adam's moments in {moments[0]} and {moments[1]}")
    return ", ".join(parts)


def wrapped_by_keras_mp(model):
    """`(label, description)` of the optimizers keras_mp wrapped for `model`."""
    return list(getattr(model, _WRAPPED, []))
