"""Where a layer sits, and the conditions the precision rules ask of it.

A condition is a function of `(layer, place)` returning a bool; `rules.py`
reads its table's rows as tuples of them. `Place` holds what a condition
may ask besides the layer: the settings and where the layer sits.
"""

import dataclasses

import keras

from keras_mp._src import backends
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import ALLOW_LIST
from keras_mp._src.precision.layer_kinds import DENY_LIST
from keras_mp._src.precision.layer_kinds import is_attention
from keras_mp._src.precision.layer_kinds import is_normalization
from keras_mp._src.precision.layer_kinds import is_router
from keras_mp._src.precision.layer_kinds import matches
from keras_mp._src.precision.layer_kinds import runs_unknown_arithmetic
from keras_mp._src.precision.levels import Compute

# -- where a layer sits ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Place:
    """What a rule may ask besides the layer: the settings and its place.

    Attributes:
        amp: the `AmpSettings` being applied.
        model: the model `apply_amp` was given.
        parent: the layer that calls this one (None for the model).
        output: whether its outputs are the model's outputs.
        inside_allowed: whether it sits inside an allow-listed layer (O1).
        inside_denied: whether it sits inside a nested model named in `deny=`.
        first: whether it takes the model's raw inputs (`float8.first_layers`).
        head: None, or whether a bounded activation keeps in range the
            output it makes: it is an output layer, or a layer on the way
            back from one to the first layer with weights on each path
            (`float8.head_layers`).
        loss: a head's output's `(loss name, whether a cross-entropy)`, or
            None (`output_losses.of_outputs`).
    """

    amp: object
    model: object
    parent: object = None
    output: bool = False
    inside_allowed: bool = False
    inside_denied: bool = False
    first: bool = False
    head: object = None
    loss: tuple = None


# -- conditions: (layer, place) -> bool -----------------------------------------


def layer_is(test):
    """A condition from a test of the layer alone (`layer_kinds.py`)."""

    def condition(layer, place):
        return test(layer)

    condition.__name__ = getattr(test, "__name__", "layer_is")
    return condition


def is_model_io(layer, place):
    """A subclassed model that is the model, or one of its outputs: its
    `call` is a forward pass, whose inputs and outputs are float32."""
    return layer_tree.is_subclassed(layer) and (layer is place.model or place.output)


def is_container(layer, place):
    return layer_tree.is_container(layer)


def is_output(layer, place):
    return place.output


def is_first(layer, place):
    return place.first


def is_head(layer, place):
    return place.head is not None


def in_float8(layer, place):
    """The level computes its chosen matmuls in FP8 (`amp_dtype="float8"`)."""
    return place.amp.float8 is not None


def inside_allowed(layer, place):
    return place.inside_allowed


def on_allow_list(layer, place):
    return matches(layer, ALLOW_LIST + place.amp.allow)


def denied(layer, place):
    """On the deny-list, the user's `deny=`, or a normalisation."""
    return matches(layer, DENY_LIST + place.amp.deny) or is_normalization(layer)


def not_denied(layer, place):
    return not denied(layer, place)


def user_denied(layer, place):
    """Named in `deny=`, or inside a nested model that is (all of it float32)."""
    return matches(layer, place.amp.deny) or place.inside_denied


def not_user_allowed(layer, place):
    """The user did not name it in `allow=` (which overrides the float32
    rows for layers it names)."""
    return not matches(layer, place.amp.allow)


def router(layer, place):
    return is_router(layer, place.parent)


def attention_needs_float32_here(layer, place):
    return is_attention(layer) and backends.current.half_attention_needs_float32(place.amp.half)


def keep_batchnorm_fp32(layer, place):
    return isinstance(layer, keras.layers.BatchNormalization) and place.amp.keep_batchnorm_fp32


def computes(*computes):
    """The level computes in half on these (`levels.Compute`)."""

    def condition(layer, place):
        return place.amp.compute in computes

    condition.__name__ = f"computes({', '.join(c.name for c in computes)})"
    return condition


def in_float16_at(*computes_):
    """float16 (not bfloat16) at a level that computes as `computes_`."""
    at = computes(*computes_)

    def condition(layer, place):
        return place.amp.half == "float16" and at(layer, place)

    condition.__name__ = f"in_float16_at({', '.join(c.name for c in computes_)})"
    return condition


def own_arithmetic_in_float32(layer, place):
    """A composite layer of the user's at O2 in float16, not in `allow=`:
    its own arithmetic (and a subclassed model's own `call`) in float32."""
    return (
        in_float16_at(Compute.DENY)(layer, place)
        and runs_unknown_arithmetic(layer)
        and not_user_allowed(layer, place)
    )


def may_overflow_float16(layer, place):
    """A rule's condition: a layer making a float16 output that nothing
    bounds (`Place.head`: no bounded activation on its way out), its loss no
    cross-entropy (a regression's, or one keras_mp does not know)."""
    known = place.loss is not None and place.loss[1]
    return place.head is False and place.amp.half == "float16" and not known


def frozen(layer, place):
    """A layer that does not train (`trainable=False`, or a frozen kernel:
    a frozen base, the layers `enable_lora` leaves alone)."""
    kernel = getattr(layer, "_kernel", None) if layer.built else None
    return not layer.trainable or (kernel is not None and not kernel.trainable)
