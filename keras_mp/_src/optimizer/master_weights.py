"""Float32 master weights for half-precision variables (Apex O2, DeepSpeed).

At O3 the model's variables are float16 or bfloat16. An optimizer that
updates them in place rounds every update to the variable's precision, and
an update smaller than half the spacing between neighbouring half values at
the weight's magnitude (for bfloat16, 2**-8 of the weight) is lost entirely:
with ordinary learning rates such weights stop learning. Master weights keep
a float32 copy of each half variable in the optimizer. The inner optimizer is
built on, and updates, the copies (its slots are float32 too); the model's
variable is then assigned the copy rounded to its dtype. Forward and backward
passes stay in half precision; the small updates accumulate in the copy.

A copy is reconciled with its variable before each update: where the
variable no longer holds the copy's rounding (`model.set_weights`, weights
loaded without the optimizer, EMA's `finalize_variable_values`), the copy
takes the variable's value. An update never writes a stale copy back over
weights set from outside. The reconciliation is one elementwise select per
variable; the writes of a skipped step do not happen at all.

The copies are optimizer variables of the `LossScaleOptimizer` (named as
their variables, so the inner optimizer's name-based weight-decay exclusions
still match), saved and restored with it.
"""

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision.levels import HALF_DTYPES

# `master_weights`'s third value: bfloat16 compensation buffers (`compensated.py`).
COMPENSATED = "compensated"


def float32_grads_of(optimizer):
    """A `LossScaleOptimizer`'s taker of float32 gradients
    (`backends.torch.Float32Grads`), or None: no master copies, or a
    backend that keeps its half gradients."""
    masters = optimizer._masters
    return None if masters is None else masters.float32_grads


def check_master_weights(master_weights, allowed_none=False):
    """`True`, `False` or `"compensated"` (or `None`, where it means the default)."""
    if master_weights is None and allowed_none:
        return
    if master_weights is True or master_weights is False or master_weights == COMPENSATED:
        return
    allowed = "True (float32 copies), False (none) or 'compensated' (bfloat16 buffers)"
    if allowed_none:
        allowed += ", or None (True)"
    error = ValueError if isinstance(master_weights, str) else TypeError
    raise error(f"`master_weights` must be {allowed}. Received: master_weights={master_weights!r}")


def state_name(variable, suffix=None):
    """The name of optimizer state kept for `variable`: its path, which
    Keras's variable names cannot hold with its `/` (`dense_1_kernel`),
    and `suffix`. Under the optimizer's path, and in the inner optimizer's
    slots' (`adam/loss_scale_optimizer_dense_1_kernel_momentum`), it says
    whose state it is in `optimizer.variables`, checkpoints and layout maps."""
    name = variable.path.replace("/", "_")
    return name if suffix is None else f"{name}_{suffix}"


def is_half(variable):
    return keras.backend.standardize_dtype(variable.dtype) in HALF_DTYPES


class MasterWeights:
    """The float32 copies of an optimizer's half trainable variables.

    Args:
        optimizer: the `LossScaleOptimizer` whose variables hold the copies.
        var_list: the trainable variables it is built with.
        skip: indices into `var_list` of variables that get no copy
            (`overwrite_with_gradient`: their "gradient" is their new value).
    """

    def __init__(self, optimizer, var_list, skip=frozenset(), layout_of=None):
        layout_of = layout_of or keras_internals.variable_layout
        self.positions = [i for i, v in enumerate(var_list) if is_half(v) and i not in skip]
        self.copies = {}
        first = len(optimizer._variables)
        for i in self.positions:
            variable = var_list[i]
            self.copies[i] = optimizer.add_variable(
                shape=variable.shape,
                # Zeros, then the variable's value: every step reconciles
                # the copy first (zero rounds to zero, so where the variable
                # is zero the copy already holds it), or the optimizer's
                # saved state restores it. Not the variable's value here:
                # TensorFlow builds the optimizer inside the first traced
                # step, and a variable whose initial value reads another
                # cannot be lifted out of it, which XLA (Keras's default on
                # a GPU) refuses.
                initializer="zeros",
                dtype="float32",
                name=state_name(variable),
                layout=layout_of(variable),
            )
        # What each variable's storage was when last written here (PyTorch):
        # unchanged since, it needs no reconciliation.
        self.write_marks = {}
        # Where the copies sit among the optimizer's own variables.
        self.own_indices = {i: first + k for k, i in enumerate(self.positions)}
        # PyTorch: the half gradients, taken in float32 as the backward pass
        # makes them (while Keras's own train step runs).
        self.float32_grads = None
        if backends.current.Float32Grads is not None and self.positions:
            half = [var_list[i] for i in self.positions]
            self.float32_grads = backends.current.Float32Grads(half)

    def __bool__(self):
        return bool(self.positions)

    def targets(self, var_list):
        """`var_list` with each half variable replaced by its float32 copy."""
        targets = list(var_list)
        for i in self.positions:
            targets[i] = self.copies[i]
        return targets

    def exclude_copies_like(self, inner_optimizer, var_list):
        """Each copy gets its variable's weight decay, exclusions included.

        The inner optimizer decides by variable and by name pattern
        (`exclude_from_weight_decay(var_list=..., var_names=[...])`): its
        answer for the variable is pinned for the copy, whose own name (the
        variable's path) a pattern such as `"^bias$"` or the layer's name
        would judge otherwise.
        """
        if getattr(inner_optimizer, "weight_decay", None) is None:
            return
        cache = inner_optimizer.__dict__.setdefault("_exclude_from_weight_decay_cache", {})
        for i in self.positions:
            decayed = inner_optimizer._use_weight_decay(
                backends.current.as_the_optimizer_sees(var_list[i])
            )
            cache[inner_optimizer._var_key(self.copies[i])] = decayed

    # -- stateful backends (TensorFlow, PyTorch) -----------------------------

    def apply(self, apply_inner, grads, trainable_variables, index_of):
        """The inner optimizer's step on the copies, then the rounded write-back.

        Args:
            apply_inner: `(grads, variables) -> None`.
            trainable_variables: the variables being updated (any order).
            index_of: `variable -> position` in the built `var_list`.
        """
        written = self._pairs(trainable_variables, index_of)
        targets = list(trainable_variables)
        for k, variable, copy in written:
            mark = _mark(variable)
            if mark is None or self.write_marks.get(id(variable)) != mark:
                copy.assign(reconciled(copy.value, variable.value))
            targets[k] = copy
        apply_inner(grads, targets)
        for _, variable, copy in written:
            variable.assign(ops.cast(copy.value, variable.dtype))
            self.write_marks[id(variable)] = _mark(variable)

    def finalize(self, finalize_inner, var_list, index_of):
        """`finalize_variable_values` (EMA) on the copies, then the write-back.

        The copies are reconciled first, as at a step: a copy that never
        stepped (an optimizer that was built but never applied, such as the
        `optimizer` a GAN's `compile` leaves unused) holds zeros, which
        would otherwise overwrite the weights at the end of `fit`.
        """
        # Only the variables this optimizer trains: Keras's `fit` passes the
        # model's, which may hold a network no optimizer trains (an EMA copy).
        var_list = [v for v in var_list if _known(index_of, v)]
        written = self._pairs(var_list, index_of)
        targets = list(var_list)
        for k, variable, copy in written:
            copy.assign(reconciled(copy.value, variable.value))
            targets[k] = copy
        finalize_inner(targets)
        for _, variable, copy in written:
            variable.assign(ops.cast(copy.value, variable.dtype))

    def _pairs(self, variables, index_of):
        """`(position in variables, variable, copy)` of each variable with a copy."""
        pairs = []
        for k, variable in enumerate(variables):
            i = index_of(variable)
            if i in self.copies:
                pairs.append((k, variable, self.copies[i]))
        return pairs

    # -- the stateless backend (JAX) ------------------------------------------

    def stateless_apply(
        self, inner_stateless_apply, own_values, inner_values, grads, values, kept=None
    ):
        """`(new_trainable, new_own, new_inner)` from the step's values.

        `kept` (a boolean scalar, the select form of the skip): each copy is
        chosen as it is written, its old value where `kept` is False (the
        half variable is then the old copy's rounding: its own value).
        """
        targets = list(values)
        for i in self.positions:
            targets[i] = reconciled(own_values[self.own_indices[i]], values[i])
        new_targets, new_inner = inner_stateless_apply(inner_values, grads, targets)
        new_trainable = list(new_targets)
        new_own = list(own_values)
        for i in self.positions:
            copy = new_targets[i]
            if kept is None:
                new_trainable[i] = ops.cast(copy, values[i].dtype)
            else:
                # The weight is the kept copy's rounding, or its old value:
                # cast from the copy as written (`computed_once`), it reads
                # no old copy after the new one is written over it.
                copy = ops.where(kept, copy, own_values[self.own_indices[i]])
                rounding = ops.cast(backends.current.computed_once(copy), values[i].dtype)
                new_trainable[i] = ops.where(kept, rounding, values[i])
            new_own[self.own_indices[i]] = copy
        return new_trainable, new_own, list(new_inner)


def _mark(variable):
    """A host-side mark that changes whenever the variable is written, or None.

    PyTorch counts the in-place writes of each tensor (`_version`, what
    autograd checks saved tensors with); every `assign` of a Keras variable
    is one (`copy_`). Elsewhere there is no such count: None, and the copy is
    reconciled at every step (on XLA and JAX the select fuses into the
    update).
    """
    value = variable.value
    version = getattr(value, "_version", None)
    return None if version is None else (id(value), version)


def reconciled(copy, value):
    """The copy, where `value` is its rounding; elsewhere `value` in float32.

    bfloat16 compares in float32 on a GPU, where XLA then drops the pair of
    converts around the copy (`backends.common.rounded`): the backend rounds.
    """
    wide = ops.cast(value, "float32")
    if keras.backend.standardize_dtype(value.dtype) == "bfloat16":
        return ops.where(ops.equal(backends.current.rounded(copy, "bfloat16"), wide), copy, wide)
    return ops.where(ops.equal(ops.cast(copy, value.dtype), value), copy, wide)


def _known(index_of, variable):
    try:
        index_of(variable)
    except KeyError:
        return False
    return True
