"""`compile(amp_level=...)`: one keyword for mixed precision.

`import keras_mp` adds `amp_level`, `amp_dtype`, `loss_scale`,
`keep_batchnorm_fp32`, `master_weights`, `amp_allow` and `amp_deny` to
`keras.Model.compile` (`install`). Without them, `compile` is Keras's own,
called with exactly the arguments it was given. The arguments become one
`AmpSettings` (`amp_settings.py`), which sets the layers' policies and the
optimizer.
"""

import dataclasses
import functools
import inspect

import keras

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.model import atomic_save
from keras_mp._src.model import config_precision
from keras_mp._src.model import lm_step
from keras_mp._src.model import model_hooks
from keras_mp._src.model import recompiled
from keras_mp._src.model import saved_precision
from keras_mp._src.model.train_step import guard_train_step
from keras_mp._src.model.wrapping import leave_bare
from keras_mp._src.model.wrapping import needs
from keras_mp._src.model.wrapping import wrap_optimizer
from keras_mp._src.model.wrapping import wrapped_otherwise
from keras_mp._src.optimizer.inner_optimizer import clip_in_float32
from keras_mp._src.optimizer.loss_scale_optimizer import LossScaleOptimizer
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import half_initializers
from keras_mp._src.precision import policies
from keras_mp._src.precision.amp_settings import DEFAULT

Trainer = keras_internals.Trainer
_keras_compile = Trainer.compile
_keras_compile_signature = inspect.signature(_keras_compile)


def compile(model, *args, **kwargs):
    """`model.compile(...)` with the amp keywords, as a function.

    Args:
        model: a `keras.Model`.
        *args, **kwargs: `keras.Model.compile`'s arguments, plus
            `amp_level` ("O0"-"O3" or "auto"), `amp_dtype` ("float16" or
            "bfloat16", or "float8" at O2/O3: FP8 matmuls, bfloat16
            elsewhere, with `float8_recipe`, a `keras_mp.Float8Recipe` or
            a dict of its arguments), `loss_scale` ("dynamic", a number for a fixed scale,
            or None), `keep_batchnorm_fp32`, `master_weights` (None:
            True; O3's half variables are updated through float32 copies),
            `amp_allow`/`amp_deny`: `apply_amp`'s `allow`/`deny` (None:
            those of the model's latest `apply_amp`, if any; a string must
            name a layer of the model), and
            `shard_optimizer_state` (JAX under `keras.distribution`: ZeRO-1),
            `chunked_loss` (None: a language model's loss chunk by chunk
            where its logits are large, `rules.LOSS_RULES`; True: wherever
            the model allows it; False: the plain loss; an int: on, that
            many tokens a chunk).
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
    amp_dtype=DEFAULT,
    loss_scale=DEFAULT,
    keep_batchnorm_fp32=None,
    master_weights=None,
    amp_allow=None,
    amp_deny=None,
    shard_optimizer_state=False,
    float8_recipe=None,
    chunked_loss=None,
    **kwargs,
):
    if amp_level is None:
        arguments = locals()
        given = {name: arguments[name] for name in _AMP_DEFAULTS}
        if any(given[name] is not default for name, default in _AMP_DEFAULTS.items()):
            raise ValueError(amp_settings.needs_level_message(**given))
        saved_precision.restore_saved(self)
        lm_step.clear_setting(self)
        if policies.is_amp_model(self):
            args, kwargs = (), _scaled_as_keras_would(self, args, kwargs)
        result = _keras_compile(self, *args, **kwargs)
        _check_distribution(self)
        # keras_mp's optimizer reports its loss scale in `fit`'s logs; a
        # Keras optimizer leaves the step exactly as Keras builds it. Under
        # keras_mp's precision a skipped step restores BatchNorm's
        # statistics too.
        guard_train_step(self, guard=policies.is_amp_model(self))
        return result
    # `allow`/`deny`: those of the model's latest `apply_amp` unless given:
    # a layer the user denied there stays float32 under `compile`.
    allow, deny = policies.layer_lists(self)
    bound = _keras_compile_signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    amp = amp_settings.for_compile(
        amp_level,
        amp_dtype,
        loss_scale,
        keep_batchnorm_fp32,
        master_weights,
        allow if amp_allow is None else amp_allow,
        deny if amp_deny is None else amp_deny,
        shard_optimizer_state,
        float8_recipe,
        model=self,
        loss=arguments.get("loss"),
    )
    # The loss tells the head rule what the outputs hold (`output_losses.py`).
    amp = dataclasses.replace(amp, loss=arguments.get("loss"))
    lm_step.set_setting(self, lm_step.check_setting(chunked_loss), arguments.get("loss"))
    given = keras.optimizers.get(arguments["optimizer"])
    before = recompiled.kept(given)  # a built optimizer, before any recast
    policies.apply(self, amp)
    saved_precision.restore_saved(self)
    settings = dict(
        loss_scale=amp.loss_scale,
        half_variables=amp.half_variables,
        master_weights=amp.master_weights,
        shard_optimizer_state=amp.shard_optimizer_state,
    )
    optimizer = recompiled.compiled_optimizer(
        given,
        before,
        functools.partial(wrap_optimizer, **settings),
        wrapped_otherwise(given, **settings),
    )
    clip_in_float32(getattr(optimizer, "inner_optimizer", optimizer))
    # `loss_scale=None` (O1/O2 in bfloat16) leaves it bare on purpose.
    leave_bare(self, not isinstance(optimizer, keras.optimizers.LossScaleOptimizer))
    arguments["optimizer"] = optimizer
    # keras_mp decides about loss scaling; Keras must not wrap a second time.
    arguments["auto_scale_loss"] = False
    result = _keras_compile(self, **arguments)
    _check_distribution(self)
    keras_internals.record_in_compile_config(
        self,
        amp_level=amp.name,
        amp_dtype=amp.dtype_name,
        loss_scale=amp.loss_scale,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=amp.master_weights,
        float8_recipe=amp.float8.get_config() if amp.float8 is not None else None,
        chunked_loss=chunked_loss,
    )
    guard_train_step(self)
    return result


# The amp keywords other than `amp_level` and their defaults, as the
# signature above gives them: any other value needs `amp_level`.
_AMP_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(
        _compile_with_amp, follow_wrapped=False
    ).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "amp_level"
}


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


def install():
    """Adds the amp keywords to `keras.Model.compile` (idempotent), saves and
    restores each layer's precision with the compile config
    (`saved_precision.py`) and with the model's own config
    (`config_precision.py`), and installs `model_hooks.py` and
    `atomic_save.py`."""
    if Trainer.compile is not _compile_with_amp:
        # On Trainer itself, so Keras still sees `compile` as not overridden
        # and `load_model` recompiles saved models (with their amp settings).
        Trainer.compile = _compile_with_amp
    hooks = {
        "compile_from_config": saved_precision.compile_from_config_with_amp,
        "get_compile_config": saved_precision.get_compile_config_with_precision,
    }
    for name, hook in hooks.items():
        if getattr(Trainer, name) is not hook:
            setattr(Trainer, name, hook)
    saving_lib = keras_internals.saving_lib
    if saving_lib._model_from_config is not saved_precision.model_from_config_with_precision:
        saving_lib._model_from_config = saved_precision.model_from_config_with_precision
    config_precision.install()
    model_hooks.install()
    atomic_save.install()
    half_initializers.install()
