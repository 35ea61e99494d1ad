"""`compile(amp_level=...)`: one keyword for mixed precision.

`import keras_mp` adds `amp_level`, `amp_dtype`, `loss_scale`,
`keep_batchnorm_fp32` and `master_weights` to `keras.Model.compile`. Without them, `compile` is
Keras's own, called with exactly the arguments it was given.
"""

import functools
import inspect
import numbers
import warnings

import keras
from keras.src.trainers.trainer import Trainer
from keras.src.utils import io_utils

from keras_mp._src import backends
from keras_mp._src.inner_optimizer import clip_in_float32
from keras_mp._src.levels import LEVELS
from keras_mp._src.levels import check_half_dtype
from keras_mp._src.levels import get_level
from keras_mp._src.loss_scale import MAX_SCALE
from keras_mp._src.loss_scale_optimizer import LossScaleOptimizer
from keras_mp._src.master_weights import COMPENSATED
from keras_mp._src.master_weights import check_master_weights
from keras_mp._src.policies import apply_amp
from keras_mp._src.policies import check_layer_list
from keras_mp._src.policies import is_amp_model
from keras_mp._src.policies import layer_lists
from keras_mp._src.policies import precision_record
from keras_mp._src.policies import restore_precision
from keras_mp._src.train_step import guard_train_step
from keras_mp._src.wrapping import leave_bare
from keras_mp._src.wrapping import needs
from keras_mp._src.wrapping import wrap_model_optimizers
from keras_mp._src.wrapping import wrap_optimizer

AMP_ARGUMENTS = ("amp_level", "amp_dtype", "loss_scale", "keep_batchnorm_fp32", "master_weights")
# The compile config's record of each layer's precision (`precision_record`).
AMP_LAYERS = "amp_layers"
# A loaded model's record, until its compile restores it (`_restore_saved`).
_SAVED_PRECISION = "_keras_mp_saved_precision"
_DEFAULT = "default"

_keras_compile = Trainer.compile
_keras_compile_from_config = Trainer.compile_from_config
_keras_get_compile_config = Trainer.get_compile_config
_keras_compile_signature = inspect.signature(_keras_compile)
# Private in Keras (the sum of each `add_loss`/regularizer loss); absent in
# a Keras that sums them some other way, then left alone.
_keras_aggregate_additional_loss = getattr(Trainer, "_aggregate_additional_loss", None)


def pick_auto_level():
    """(level, dtype, reason) for `amp_level="auto"` on this machine."""
    try:
        capability = backends.current.gpu_compute_capability()
    except Exception:  # No usable GPU runtime: treat as a CPU machine.
        capability = None
    return auto_level_rule(capability, _cpu_flags(), keras.backend.backend())


def auto_level_rule(gpu_capability, cpu_flags, backend):
    """The rule of `amp_level="auto"`, from the machine's facts.

    - A GPU with tensor cores (compute capability >= 7.0): O2 in float16,
      with dynamic loss scaling; bfloat16 where the GPU has it natively (>= 8.0)
      needs no scaling, but float16 is the common baseline.
    - A CPU with native bfloat16 instructions (AVX512_BF16 or AMX) on the
      TensorFlow backend: O2 in bfloat16, which measured faster there on
      dense and convolutional models (the README's Performance section).
    - Otherwise O0: on CPUs, PyTorch's bfloat16 attention and JAX's half
      precision measured slower than float32.

    Args:
        gpu_capability: `(major, minor)` of the first GPU, or None.
        cpu_flags: set of /proc/cpuinfo flags.
        backend: "tensorflow", "jax" or "torch".
    """
    if gpu_capability is not None:
        major, minor = gpu_capability
        if gpu_capability >= (7, 0):
            return "O2", "float16", f"GPU with tensor cores (compute capability {major}.{minor})"
        return "O0", "float16", f"GPU without tensor cores (compute capability {major}.{minor})"
    native = sorted(set(cpu_flags) & {"avx512_bf16", "amx_bf16"})
    if backend == "tensorflow" and native:
        return "O2", "bfloat16", f"CPU with native bfloat16 ({', '.join(native)}) on {backend}"
    return "O0", "float16", f"half precision is slower than float32 on this CPU with {backend}"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _check_amp_arguments(amp_level, amp_dtype, loss_scale, keep_batchnorm_fp32, master_weights):
    if amp_level != "auto":
        get_level(amp_level, "amp_level", also=("auto",))
    if amp_dtype is not _DEFAULT:
        check_half_dtype(amp_dtype, "amp_dtype")
    if not (
        loss_scale is None
        or loss_scale is _DEFAULT
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
    if keep_batchnorm_fp32 is not None and not isinstance(keep_batchnorm_fp32, bool):
        raise TypeError(
            "`keep_batchnorm_fp32` must be True, False or None. "
            f"Received: keep_batchnorm_fp32={keep_batchnorm_fp32!r}"
        )
    check_master_weights(master_weights, allowed_none=True)


def resolve_amp(
    amp_level,
    amp_dtype=_DEFAULT,
    loss_scale=_DEFAULT,
    keep_batchnorm_fp32=None,
    master_weights=None,
):
    """Validated, explicit amp settings: (level, dtype, loss_scale, keep_bn)."""
    _check_amp_arguments(amp_level, amp_dtype, loss_scale, keep_batchnorm_fp32, master_weights)
    if amp_level == "auto":
        level, auto_dtype, reason = pick_auto_level()
        dtype = auto_dtype if amp_dtype is _DEFAULT else amp_dtype
        if level == "O0":
            io_utils.print_msg(
                f"keras_mp: amp_level='auto' picked O0 (float32 everywhere): "
                f"{reason}. Pass amp_level='O2' to train in half precision anyway."
            )
        else:
            io_utils.print_msg(f"keras_mp: amp_level='auto' picked {level} in {dtype}: {reason}.")
    else:
        level = get_level(amp_level).name
        dtype = "float16" if amp_dtype is _DEFAULT else check_half_dtype(amp_dtype, "amp_dtype")
    if master_weights == COMPENSATED and dtype == "float16":
        raise ValueError(
            "`master_weights='compensated'` compensates bfloat16 variables; "
            "float16 optimizer slots underflow. Use amp_dtype='bfloat16', or "
            "master_weights=True with float16. Received: amp_dtype='float16', "
            "master_weights='compensated'"
        )
    if loss_scale is _DEFAULT:
        # float16 at O1/O2: a dynamic scale. Elsewhere in half a fixed scale
        # of 1, which checks each step and skips a non-finite one (at O3 the
        # master weights' wrapper does so too); `loss_scale=None` opts out
        # at O1/O2.
        spec = get_level(level)
        if dtype == "float16" and spec.float16_loss_scale:
            loss_scale = "dynamic"
        elif spec.half_compute != "none" and not spec.half_variables:
            loss_scale = 1.0
        else:
            loss_scale = None
    return level, dtype, loss_scale, keep_batchnorm_fp32


def compile(model, *args, **kwargs):
    """`model.compile(...)` with the amp keywords, as a function.

    Args:
        model: a `keras.Model`.
        *args, **kwargs: `keras.Model.compile`'s arguments, plus
            `amp_level` ("O0"-"O3" or "auto"), `amp_dtype` ("float16" or
            "bfloat16"), `loss_scale` ("dynamic", a number for a fixed scale,
            or None), `keep_batchnorm_fp32`, `master_weights` (None:
            True; O3's half variables are updated through float32 copies),
            and `amp_allow`/`amp_deny`: `apply_amp`'s `allow`/`deny` (None:
            those of the model's latest `apply_amp`, if any).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    return _compile_with_amp(model, *args, **kwargs)


@functools.wraps(_keras_compile)
def _compile_with_amp(
    self,
    *args,
    amp_level=None,
    amp_dtype=_DEFAULT,
    loss_scale=_DEFAULT,
    keep_batchnorm_fp32=None,
    master_weights=None,
    amp_allow=None,
    amp_deny=None,
    **kwargs,
):
    if amp_level is None:
        if (
            amp_dtype is not _DEFAULT
            or loss_scale is not _DEFAULT
            or keep_batchnorm_fp32 is not None
            or master_weights is not None
            or amp_allow is not None
            or amp_deny is not None
        ):
            raise ValueError(
                "`amp_dtype`, `loss_scale`, `keep_batchnorm_fp32`, "
                "`master_weights`, `amp_allow` and `amp_deny` need `amp_level` "
                f"(one of {', '.join(LEVELS)} or 'auto'). Received: "
                f"amp_level=None, amp_dtype={amp_dtype!r}, "
                f"loss_scale={loss_scale!r}, "
                f"keep_batchnorm_fp32={keep_batchnorm_fp32!r}, "
                f"master_weights={master_weights!r}, "
                f"amp_allow={amp_allow!r}, amp_deny={amp_deny!r}"
            )
        _restore_saved(self)
        if is_amp_model(self):
            args, kwargs = (), _scaled_as_keras_would(self, args, kwargs)
        result = _keras_compile(self, *args, **kwargs)
        _check_distribution(self)
        # keras_mp's optimizer reports its loss scale in `fit`'s logs; a
        # Keras optimizer leaves the step exactly as Keras builds it. Under
        # keras_mp's precision a skipped step restores BatchNorm's
        # statistics too.
        guard_train_step(self, guard=is_amp_model(self))
        return result
    level, dtype, loss_scale, keep_batchnorm_fp32 = resolve_amp(
        amp_level, amp_dtype, loss_scale, keep_batchnorm_fp32, master_weights
    )
    # Those of the model's latest `apply_amp` unless given: a layer the
    # user denied there stays float32 under `compile(amp_level=...)`.
    allow, deny = layer_lists(self)
    if amp_allow is not None:
        allow = check_layer_list(amp_allow, "amp_allow")
    if amp_deny is not None:
        deny = check_layer_list(amp_deny, "amp_deny")
    bound = _keras_compile_signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    apply_amp(self, level, dtype, keep_batchnorm_fp32=keep_batchnorm_fp32, allow=allow, deny=deny)
    _restore_saved(self)
    optimizer = wrap_optimizer(
        keras.optimizers.get(arguments["optimizer"]),
        loss_scale,
        half_variables=get_level(level).half_variables,
        master_weights=master_weights,
    )
    clip_in_float32(getattr(optimizer, "inner_optimizer", optimizer))
    # `loss_scale=None` (O1/O2 in bfloat16) leaves it bare on purpose.
    leave_bare(self, not isinstance(optimizer, keras.optimizers.LossScaleOptimizer))
    arguments["optimizer"] = optimizer
    # keras_mp decides about loss scaling; Keras must not wrap a second time.
    arguments["auto_scale_loss"] = False
    result = _keras_compile(self, **arguments)
    _check_distribution(self)
    self._compile_config.config.update(
        amp_level=level,
        amp_dtype=dtype,
        loss_scale=loss_scale,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
    )
    guard_train_step(self)
    return result


def _scaled_as_keras_would(model, args, kwargs):
    """Keras's `auto_scale_loss` for a model whose precision keras_mp set.

    Keras wraps the optimizer in a LossScaleOptimizer when the model's own
    policy is mixed_float16. Under `apply_amp` (or `to_float`) layers compute
    in float16 with float32 variables whatever the model's own policy: a
    subclassed model's is float32 (its inputs and outputs), so Keras would
    not wrap, and its float16 gradients would go unscaled (a functional
    model's Keras would wrap in its own). A plain `compile` of such a model
    wraps the optimizer in keras_mp's with what the layers need
    (`wrapping.needs`): a dynamic scale for float16 layers, as under Keras's
    global mixed_float16; at O3 the float32 master weights, and in bfloat16
    the skip of a non-finite step, which Keras's half policies lack. Not
    with `auto_scale_loss=False`, which leaves every optimizer of the model
    bare. Returns `compile`'s keyword arguments.
    """
    arguments = _keras_compile_signature.bind(model, *args, **kwargs).arguments
    arguments.pop("self")
    bare = not arguments.get("auto_scale_loss", True)
    leave_bare(model, bare)
    loss_scale = needs(model)
    if bare or loss_scale is None:
        return arguments
    optimizer = keras.optimizers.get(arguments.get("optimizer", "rmsprop"))
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = wrap_optimizer(optimizer, loss_scale, half_variables=True, master_weights=None)
        clip_in_float32(optimizer.inner_optimizer)
    arguments["optimizer"] = optimizer
    return arguments


def _check_distribution(model):
    """Refuses, at compile time rather than mid-fit, what the step cannot run under."""
    if isinstance(model.optimizer, LossScaleOptimizer):
        backends.current.check_compile(model)


@functools.wraps(_keras_get_compile_config)
def _get_compile_config_with_precision(self):
    """Keras's compile config; for a model whose precision keras_mp set, with
    each layer's (`precision_record`), as it is when the config is taken:
    a `to_float` after `compile` is saved too."""
    config = _keras_get_compile_config(self)
    if config and is_amp_model(self):
        config = {**config, AMP_LAYERS: precision_record(self)}
    return config


def _restore_saved(model):
    """Gives a loaded model the precision its compile config recorded, once:
    after its level is applied and before its optimizer is built."""
    record = model.__dict__.pop(_SAVED_PRECISION, None)
    if record is not None and not restore_precision(model, record):
        warnings.warn(
            f"keras_mp: the per-layer precision saved in the compile config "
            f"does not match model {model.name!r} ({len(record)} layers "
            f"saved; its layers differ in number or class), so it was not "
            f"applied; the model has its level's precision instead.",
            stacklevel=3,
        )


@functools.wraps(_keras_compile_from_config)
def _compile_from_config_with_amp(self, config):
    """`load_model`'s recompile; the precision and the optimizer come back.

    Keras does not call a `compile` that a model class overrides (KerasHub's
    task models do) when it loads the model, so their amp settings would be
    dropped with it and the model would come back computing in whatever its
    layers' configs say. The saved level is applied here first: the policies,
    the boundary casts and O3's half variables are restored before the
    weights are loaded. A model whose `compile` is Keras's is then compiled
    with its amp settings, as before; so is one whose own `compile` takes
    every saved argument (KerasHub's tasks pass them on to Keras's), or its
    optimizer, the loss scale with it, would not be loaded: the model would
    resume with the optimizer its constructor made, from scale 2**15.

    Each layer's own precision, as saved (`AMP_LAYERS`), is then given back
    by the compile, after the level and before the optimizer is built (or
    here, where no compile runs): what `allow`/`deny` and `to_float` chose,
    and the layers a block of the user's makes, which its config does not
    hold.
    """
    if not isinstance(config, dict):
        return _keras_compile_from_config(self, config)
    config = dict(config)
    record = config.pop(AMP_LAYERS, None)
    if record is not None:
        object.__setattr__(self, _SAVED_PRECISION, record)
    try:
        amp = {k: config.get(k) for k in AMP_ARGUMENTS}
        if amp["amp_level"] is not None:
            apply_amp(
                self,
                amp["amp_level"],
                amp["amp_dtype"] or "float16",
                keep_batchnorm_fp32=amp["keep_batchnorm_fp32"],
            )
            if type(self).compile is not Trainer.compile and _takes(self.compile, config):
                self.compile(**keras.saving.deserialize_keras_object(config))
                if self.built and getattr(self, "optimizer", None) is not None:
                    self.optimizer.build(self.trainable_variables)  # as Keras's does
                return None
        return _keras_compile_from_config(self, config)
    finally:
        _restore_saved(self)  # a model that Keras left uncompiled


def _takes(method, config):
    """Whether `method` accepts `config`'s items as keyword arguments."""
    try:
        inspect.signature(method).bind(**config)
    except TypeError:
        return False
    return True


def _aggregate_additional_loss_in_floatx(self, loss):
    """A layer's `add_loss`, activity or weight regularization loss, in floatx.

    A layer computing in half adds its activity regularization (and O3's
    half weights their `kernel_regularizer` losses) in half; Keras then sums
    them with the float32 loss, which TensorFlow refuses ("Cannot convert a
    list containing a tensor of dtype float16 to float32"), under Keras's own
    mixed policies too. tf.keras 2 cast them to the widest dtype first
    (`cast_losses_to_common_dtype`); so does this, before the sum, for the
    models whose precision keras_mp set. Other models get Keras's own.
    """
    if (
        is_amp_model(self)
        and keras.backend.standardize_dtype(loss.dtype) in ("float16", "bfloat16")
        and keras.config.floatx() in ("float32", "float64")
    ):
        loss = keras.ops.cast(loss, keras.config.floatx())
    return _keras_aggregate_additional_loss(self, loss)


def _with_optimizers_prepared(method):
    """`fit` / `train_on_batch` / `load_weights` of a model whose precision
    keras_mp set: first, every bare optimizer it holds is wrapped as its
    precision needs (`wrapping.wrap_model_optimizers`): a `compile` of the
    model's own may keep them in attributes of its own (a GAN's
    `d_optimizer`); weights saved after training load into the wrappers they
    were saved from. Other models get Keras's own, untouched."""

    @functools.wraps(method)
    def prepared(self, *args, **kwargs):
        if is_amp_model(self) and wrap_model_optimizers(self):
            had_own = method.__name__ in self.__dict__
            guard_train_step(self, guard=True)
            if not had_own and method.__name__ in self.__dict__:
                # Through the model's own `fit` now (the logs' telemetry).
                return getattr(self, method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    prepared._keras_mp_prepared = True
    return prepared


def _install_preparation():
    for name in ("fit", "train_on_batch", "load_weights"):
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        if not getattr(owner.__dict__[name], "_keras_mp_prepared", False):
            setattr(owner, name, _with_optimizers_prepared(owner.__dict__[name]))


def install():
    """Adds the amp keywords to `keras.Model.compile` (idempotent), saves and
    restores each layer's precision with the compile config, and sums half
    additional losses in floatx (`_aggregate_additional_loss_in_floatx`)."""
    if Trainer.compile is not _compile_with_amp:
        # On Trainer itself, so Keras still sees `compile` as not overridden
        # and `load_model` recompiles saved models (with their amp settings).
        Trainer.compile = _compile_with_amp
    if Trainer.compile_from_config is not _compile_from_config_with_amp:
        Trainer.compile_from_config = _compile_from_config_with_amp
    if Trainer.get_compile_config is not _get_compile_config_with_precision:
        Trainer.get_compile_config = _get_compile_config_with_precision
    if _keras_aggregate_additional_loss is not None:
        Trainer._aggregate_additional_loss = _aggregate_additional_loss_in_floatx
    _install_preparation()
