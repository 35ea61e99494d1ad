"""What keras_mp changes in Keras's `Model` beyond `compile`, for the models
whose precision it set (`policies.is_amp_model`); other models get Keras's own.

- `fit`, `train_on_batch` and `load_weights` first wrap every bare optimizer
  the model holds (`wrapping.wrap_model_optimizers`).
- Around `fit`, no two of its variables share one value (JAX, `use_ema=True`).
- A layer's half `add_loss`/regularization losses are summed in floatx.

Installed by `compile.install`.
"""

import functools
import re

import keras

from keras_mp._src import keras_internals
from keras_mp._src.model.train_step import guard_train_step
from keras_mp._src.model.wrapping import find_optimizers
from keras_mp._src.model.wrapping import wrap_model_optimizers
from keras_mp._src.precision import layer_policy
from keras_mp._src.precision.policies import is_amp_model

_keras_aggregate_additional_loss = keras_internals.aggregate_additional_loss


def aggregate_additional_loss_in_floatx(self, loss):
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
        if not is_amp_model(self) or method.__name__ != "fit":
            return method(self, *args, **kwargs)
        _own_buffers(self)
        try:
            return method(self, *args, **kwargs)
        finally:
            _own_buffers(self)

    prepared._keras_mp_prepared = True
    return prepared


def _own_buffers(model):
    """Gives each of the model's and its optimizers' variables a value of its
    own, before and after `fit`.

    `fit` ends with `finalize_variable_values`, which with `use_ema=True`
    assigns each weight its moving average: on JAX the weight and the
    average then hold the same array, and the next `fit` (or a `jax.jit`
    loop) that donates the state fails ("Attempt to donate the same buffer
    twice"), under Keras's own policies too. A shared value is copied; on
    TensorFlow and PyTorch every variable holds its own buffer already.
    """
    variables = list(model.variables) + list(model.metrics_variables)
    for held in find_optimizers(model):
        variables += held.optimizer.variables
        inner = getattr(held.optimizer, "inner_optimizer", None)
        variables += inner.variables if inner is not None else []
    if not keras_internals.hold_values(variables):  # a JAX `fit` that failed
        return
    values = {}  # id -> value, each kept alive while ids are compared
    for variable in {id(v): v for v in variables}.values():
        value = variable.value
        if id(value) in values:
            variable.assign(keras.ops.copy(value))
        values[id(value)] = value


# Keras's float8 Dense and EinsumDense hold 6 variables beside their kernel
# and bias: 3 scales and 3 amax histories.
_FLOAT8_EXTRA_VARIABLES = 6
_EXPECTED_VARIABLES = re.compile(r"expected (\d+) variables, but received (\d+) variables")
# Keras's loading error lists the layers it could not load by their repr.
_NOT_LOADED = re.compile(r"<\w+ name=([^,>]+), built=")


def _with_float8_order_named(method):
    """`load_weights` of FP8 weights (saved at `amp_dtype="float8"`).

    Into a model at `amp_dtype="float8"` whose rules keep in bfloat16 a layer
    the weights hold in FP8 (saved under another `Float8Recipe(small_gemm=)`,
    or `allow=`): that layer is put in FP8 and the weights load, as a
    `.keras` file's do. Into a model not at float8 yet: Keras's error, which
    counts variables only, names the order that works."""

    @functools.wraps(method)
    def load_weights(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ValueError as error:
            counts = _EXPECTED_VARIABLES.search(str(error))
            if counts is None:
                raise
            expected, received = map(int, counts.groups())
            if received - expected != _FLOAT8_EXTRA_VARIABLES:
                raise
            names = set(_NOT_LOADED.findall(str(error).rsplit("could not be loaded:", 1)[-1]))
            if not layer_policy.to_float8(self, names):
                raise ValueError(_compile_first(error)) from error
        return method(self, *args, **kwargs)

    load_weights._keras_mp_float8_order = True
    return load_weights


def _compile_first(error):
    return (
        f"{error}\n\nkeras_mp: these weights were saved from FP8 layers "
        "(`amp_dtype='float8'`: each Dense holds 3 scales and 3 amax "
        "histories beside its kernel and bias). Compile the model at the "
        "level it was saved at first, then load: "
        "`model.compile(..., amp_level='O2', amp_dtype='float8')`, then "
        "`model.load_weights(path)` (a `.keras` file needs only "
        "`keras.models.load_model(path)`)."
    )


def install_preparation():
    for name in ("fit", "train_on_batch", "load_weights"):
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        if not getattr(owner.__dict__[name], "_keras_mp_prepared", False):
            setattr(owner, name, _with_optimizers_prepared(owner.__dict__[name]))
    owner = next(c for c in keras.Model.__mro__ if "load_weights" in c.__dict__)
    if not getattr(owner.__dict__["load_weights"], "_keras_mp_float8_order", False):
        owner.load_weights = _with_float8_order_named(owner.__dict__["load_weights"])


def install():
    """Installs both (idempotent)."""
    install_preparation()
    trainer = keras_internals.Trainer
    if _keras_aggregate_additional_loss is not None:
        trainer._aggregate_additional_loss = aggregate_additional_loss_in_floatx
