"""A level resolved once: `AmpSettings`, made from the user's arguments.

`apply_amp(model, level, dtype, ...)` and `compile(amp_level=..., ...)`
check their arguments here and get one frozen object back: the level's row
of the table (`levels.py`), the half dtype, BatchNorm's dtype, the user's
`allow`/`deny`, the loss scale and the master weights. The precision rules
(`rules.py`), the policies (`policies.py`) and the optimizer wrapping
(`compile.py`) read it; none of them looks a level up by name again.
"""

import dataclasses
import numbers

import keras

from keras_mp._src import keras_internals
from keras_mp._src.backends import cpu_rates
from keras_mp._src.optimizer import zero
from keras_mp._src.optimizer.loss_scale import MAX_SCALE
from keras_mp._src.optimizer.master_weights import COMPENSATED
from keras_mp._src.optimizer.master_weights import check_master_weights
from keras_mp._src.precision import float8
from keras_mp._src.precision.auto_level import pick_auto_level
from keras_mp._src.precision.levels import FLOAT8
from keras_mp._src.precision.levels import LEVELS
from keras_mp._src.precision.levels import Compute
from keras_mp._src.precision.levels import Level
from keras_mp._src.precision.levels import check_float8_level
from keras_mp._src.precision.levels import check_half_dtype
from keras_mp._src.precision.levels import get_level

# An argument the user left out (where None means something else).
DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class AmpSettings:
    """Everything a precision level means for one model, resolved.

    Attributes:
        level: the `Level` (its row of the level table).
        half: `"float16"` or `"bfloat16"`.
        keep_batchnorm_fp32: bool, resolved from the level's default.
        allow: the user's `allow` entries (classes, names, layers).
        deny: the user's `deny` entries.
        loss_scale: `"dynamic"`, a fixed scale, or None (no wrapper).
        master_weights: None (True), True, False or `"compensated"`.
        shard_optimizer_state: bool; True shards the optimizer's state
            over the data-parallel replicas (`zero.py`).
        float8: a `Float8Recipe` where the level computes its chosen
            matmuls in FP8 (`amp_dtype="float8"`; `half` is then bfloat16),
            else None.
        loss: the loss `compile` was given (None: not known, as under
            `apply_amp`); the head rule reads it (`output_losses.py`).
        auto: under `amp_level="auto"`, what it picked and why (one line,
            which `precision_summary` shows); else None.
        list_arguments: what the user called `allow` and `deny` (`apply_amp`'s
            names, or `compile`'s `amp_allow`/`amp_deny`), for the errors.
    """

    level: Level
    half: str = "float16"
    keep_batchnorm_fp32: bool = True
    allow: tuple = ()
    deny: tuple = ()
    loss_scale: object = None
    master_weights: object = None
    shard_optimizer_state: bool = False
    float8: object = None
    loss: object = None
    auto: object = None
    list_arguments: tuple = ("allow", "deny")

    @property
    def name(self):
        return self.level.name

    @property
    def dtype_name(self):
        """The dtype as the user named it: the half dtype, or `"float8"`."""
        return FLOAT8 if self.float8 is not None else self.half

    @property
    def compute(self):
        return self.level.compute

    @property
    def half_variables(self):
        return self.level.half_variables

    @property
    def mixed(self):
        """The policy of a layer computing in half with float32 variables."""
        return f"mixed_{self.half}"

    @property
    def inner_dtype(self):
        """What a subclassed model's own `call` computes in (its inputs are
        cast to it): half at O2 and O3, float32 at O0 and O1."""
        return self.half if self.compute in (Compute.DENY, Compute.ALL) else "float32"

    @property
    def container_policy(self):
        """A nested model's own policy (it computes nothing; it casts inputs)."""
        return {Compute.ALL: self.half, Compute.DENY: self.mixed}.get(self.compute, "float32")


def check_layer_list(value, argument):
    """`allow`/`deny` as a tuple of layer classes, names and layers."""
    if value is None:
        return ()
    if isinstance(value, (str, type, keras.layers.Layer)):
        value = (value,)
    try:
        entries = tuple(value)
    except TypeError:
        entries = None
    if entries is None or not all(
        isinstance(e, (str, keras.layers.Layer))
        or (isinstance(e, type) and issubclass(e, keras.layers.Layer))
        for e in entries
    ):
        raise TypeError(
            f"`{argument}` must be a list of layer classes (subclasses of "
            f"`keras.layers.Layer`), layer names (strings) or layers. "
            f"Received: {argument}={value!r}"
        )
    return entries


def check_keep_batchnorm_fp32(value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            "`keep_batchnorm_fp32` must be True, False or None. "
            f"Received: keep_batchnorm_fp32={value!r}"
        )


def check_loss_scale(loss_scale):
    if not (
        loss_scale is None
        or loss_scale is DEFAULT
        or loss_scale == "dynamic"
        or (
            isinstance(loss_scale, numbers.Real)
            and not isinstance(loss_scale, bool)
            and 0 < loss_scale <= MAX_SCALE
        )
    ):
        raise ValueError(
            '`loss_scale` must be "dynamic", a number greater than 0 and at '
            "most 2**126 (a fixed scale), or None. Received: "
            f"loss_scale={loss_scale!r}"
        )


def _keep_batchnorm_fp32(value, level):
    """`keep_batchnorm_fp32` as given, or the level's default for None."""
    return level.keep_batchnorm_fp32_default if value is None else value


def _float8(level, dtype, recipe, argument, dtype_argument, recipe_argument):
    """(half, recipe or None) of a checked dtype: FP8 computes in bfloat16
    around its matmuls, at O2 and O3 only."""
    if dtype != FLOAT8:
        if recipe is not None:
            raise ValueError(
                f"`{recipe_argument}` needs `{dtype_argument}='float8'`. "
                f"Received: {dtype_argument}={dtype!r}, {recipe_argument}={recipe!r}"
            )
        return dtype, None
    check_float8_level(level, argument, dtype_argument)
    return "bfloat16", float8.check_recipe(recipe, recipe_argument)


def for_layers(
    level, dtype="float16", keep_batchnorm_fp32=None, allow=None, deny=None, float8_recipe=None
):
    """`apply_amp`'s settings: its arguments checked, named as it names them."""
    cpu_rates.tied_head_form()  # and the environment's KERAS_MP_TIED_HEAD
    level = get_level(level)
    half, recipe = _float8(
        level,
        check_half_dtype(dtype, float8=True),
        float8_recipe,
        "level",
        "dtype",
        "float8_recipe",
    )
    check_keep_batchnorm_fp32(keep_batchnorm_fp32)
    return AmpSettings(
        level,
        half,
        _keep_batchnorm_fp32(keep_batchnorm_fp32, level),
        allow=check_layer_list(allow, "allow"),
        deny=check_layer_list(deny, "deny"),
        float8=recipe,
    )


def for_compile(
    amp_level,
    amp_dtype=DEFAULT,
    loss_scale=DEFAULT,
    keep_batchnorm_fp32=None,
    master_weights=None,
    amp_allow=(),
    amp_deny=(),
    shard_optimizer_state=False,
    float8_recipe=None,
    model=None,
    loss=None,
):
    """`compile(amp_level=...)`'s settings; `"auto"` is picked here, once,
    for `model` (its step predicted, with `loss` for the head rule)."""
    cpu_rates.tied_head_form()  # and the environment's KERAS_MP_TIED_HEAD
    if amp_level != "auto":
        get_level(amp_level, "amp_level", also=("auto",))
    given_half = (
        None if amp_dtype is DEFAULT else check_half_dtype(amp_dtype, "amp_dtype", float8=True)
    )
    if given_half == FLOAT8 and amp_level == "auto":
        raise ValueError(
            "`amp_dtype='float8'` needs `amp_level` to be 'O2' or 'O3' (FP8 "
            "matmuls, bfloat16 elsewhere); 'auto' picks a level for the machine "
            "it runs on. Received: amp_level='auto', amp_dtype='float8'"
        )
    check_loss_scale(loss_scale)
    check_keep_batchnorm_fp32(keep_batchnorm_fp32)
    check_master_weights(master_weights, allowed_none=True)
    zero.check_argument(shard_optimizer_state)
    allow = check_layer_list(amp_allow, "amp_allow")
    deny = check_layer_list(amp_deny, "amp_deny")
    auto = None
    if amp_level == "auto":

        def settings_for(name, half):
            settings = for_layers(name, half, keep_batchnorm_fp32, allow, deny)
            return dataclasses.replace(settings, loss=loss)

        name, auto_dtype, reason = pick_auto_level(given_half, model, settings_for)
        level = get_level(name)
        half = given_half or auto_dtype
        if level.computes_in_half:
            auto = f"amp_level='auto' picked {level.name} in {half}: {reason}."
        else:
            auto = (
                f"amp_level='auto' picked {level.name} (float32 everywhere): {reason}. "
                "Pass amp_level='O2' to train in half precision anyway."
            )
        keras_internals.print_msg(f"keras_mp: {auto}")
    else:
        level = get_level(amp_level)
        half = given_half or "float16"
    half, recipe = _float8(level, half, float8_recipe, "amp_level", "amp_dtype", "float8_recipe")
    if master_weights == COMPENSATED and half == "float16":
        raise ValueError(
            "`master_weights='compensated'` compensates bfloat16 variables; "
            "float16 optimizer slots underflow. Use amp_dtype='bfloat16', or "
            "master_weights=True with float16. Received: amp_dtype='float16', "
            "master_weights='compensated'"
        )
    if loss_scale is DEFAULT:
        # float16 at O1/O2: a dynamic scale. Elsewhere in half a fixed scale
        # of 1, which checks each step and skips a non-finite one (at O3 the
        # master weights' wrapper does so too); `loss_scale=None` opts out
        # at O1/O2.
        if half == "float16" and level.float16_loss_scale:
            loss_scale = "dynamic"
        elif level.computes_in_half and not level.half_variables:
            loss_scale = 1.0
        else:
            loss_scale = None
    return AmpSettings(
        level,
        half,
        _keep_batchnorm_fp32(keep_batchnorm_fp32, level),
        allow,
        deny,
        loss_scale,
        master_weights,
        shard_optimizer_state,
        recipe,
        auto=auto,
        list_arguments=("amp_allow", "amp_deny"),
    )


def needs_level_message(**given):
    """The error of amp keywords given without `amp_level`."""
    return (
        "`amp_dtype`, `loss_scale`, `keep_batchnorm_fp32`, `master_weights`, "
        "`amp_allow`, `amp_deny`, `shard_optimizer_state`, `float8_recipe` and `chunked_loss` "
        "need `amp_level` "
        f"(one of {', '.join(LEVELS)} or 'auto'). Received: amp_level=None, "
        + ", ".join(f"{k}={v!r}" for k, v in given.items())
    )
