"""`fit`'s step of a language model, its loss chunk by chunk (`lm_loss.py`).

While the step runs (is traced, on TensorFlow and JAX), where the rule
says so (`rules.LOSS_RULES`, decided once per batch shape):

- the model's `call` is its trunk's (`lm_head.find`): `y_pred` is the
  hidden states the head takes in, not the logits;
- the compiled loss computes the loss from them through the head's
  weights, chunk by chunk, reduced as Keras reduces it, and updates the
  compiled `SparseCategoricalAccuracy` metrics from each chunk's argmax
  (inside the loss: on JAX that is where the step's metric values are
  carried out of the gradient's trace);
- the compiled metrics' own update is skipped (done above).

Everything is put back when the step returns: `evaluate` and `predict`
compute the logits as before, and the model's config is the user's.
"""

import contextlib
import math

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss
from keras_mp._src.precision import lm_rule
from keras_mp._src.precision import rules

SETTING = "_keras_mp_chunked_loss"
METRICS_NOT_UPDATED = (
    "the compiled metrics are not updated by a JAX train_step of your own (the "
    "logits are never made): compute them in your step, or chunked_loss=False"
)
_DECISION = "_keras_mp_loss_decision"


def set_setting(model, setting, loss):
    """`compile`'s `chunked_loss` and loss, for the step's decision; the
    head and trunk found now, outside any step's trace (the trunk is a
    model: it makes a metric's variables)."""
    lm_head.forget(model)
    object.__setattr__(model, SETTING, (setting, loss))
    model.__dict__.pop(_DECISION, None)
    _found(model)


def _found(model):
    """The model's head, looked for only where the rule asks (a loss the
    chunks compute, not turned off: `rules.LOSS_RULES`' first rows)."""
    setting, loss = model.__dict__[SETTING]
    if setting is False or lm_rule.sparse_from_logits(loss) is None:
        return lm_head.Found(why="not looked for")
    return lm_head.find(model)


def clear_setting(model):
    """A compile without `amp_level`: Keras's own step and loss."""
    model.__dict__.pop(SETTING, None)
    model.__dict__.pop(_DECISION, None)


def check_setting(value):
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value > 0:
        return value
    raise ValueError(
        "`chunked_loss` must be None (by rule: chunk by chunk where the logits are "
        "large), True (wherever the model allows it), False (the plain loss) or a "
        f"positive int (tokens a chunk). Received: chunked_loss={value!r}"
    )


def decision(model):
    """`(chunked, reason)` of the model's latest step, or None before one."""
    decided = model.__dict__.get(_DECISION)
    return None if decided is None else decided[:2]


def expected(model):
    """The rule's reason before any step (no batch known yet), or None for a
    model compiled without it."""
    if SETTING not in model.__dict__:
        return None
    setting, loss = model.__dict__[SETTING]
    facts = lm_rule.LossFacts(setting, _found(model), loss, own_step=_own_step(model))
    chunked, reason = rules.decide_loss(facts)
    if chunked and setting is None:
        # The batch's tokens decide (`lm_rule.small_logits`).
        reason = (
            f"by rule at the first step: float32 loss chunk by chunk through "
            f"`{facts.found.layer.name}` where a batch's logits (tokens x "
            f"{facts.vocabulary:,}) reach {lm_rule.LOGITS_THRESHOLD:,} elements, "
            "else the plain loss; chunked_loss=False for the plain loss"
        )
    return chunked, reason


def chunking(model, data):
    """The context the step runs in: the swaps above, or nothing."""
    if SETTING not in model.__dict__:
        return contextlib.nullcontext()
    _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    tokens = _tokens(y)
    decided = model.__dict__.get(_DECISION)
    if decided is None or decided[2].tokens != tokens:
        # Once per batch shape (PyTorch enters this at every step).
        setting, loss = model.__dict__[SETTING]
        found = _found(model)
        metric = None
        if found.layer is not None:
            # The compiled metrics, built as `fit` builds them (TensorFlow
            # builds them in its first traced step otherwise).
            keras_internals.build_for_training(model, data)
            metric = _metric_reading_logits(model)
        facts = lm_rule.LossFacts(
            setting, found, loss, metric=metric, own_step=_own_step(model), tokens=tokens
        )
        decided = rules.decide_loss(facts) + (facts,)
        object.__setattr__(model, _DECISION, decided)
    chunked, _, facts = decided
    return _Chunked(model, facts.found, facts) if chunked else contextlib.nullcontext()


def chunked_only(original, model):
    """Keras's step (or the model's own) in `chunking`, for a level without
    keras_mp's optimizer (O0), whose step `train_step.py` leaves as it is."""
    if backends.current.STATELESS:

        def train_step(state, data):
            with chunking(model, data):
                return original(state, data)

    else:

        def train_step(data):
            with chunking(model, data):
                return original(data)

    return train_step


def _own_step(model):
    return not keras_internals.is_keras_own_train_step(model)


def _tokens(y):
    """The batch's tokens, or `lm_rule.AtLeast` the known dimensions' where
    one is not known when traced (TensorFlow's batch of a `tf.data` dataset
    batched without `drop_remainder`); None without a shape."""
    shape = getattr(y, "shape", None)
    if shape is None:
        return None
    known = math.prod(d for d in shape if isinstance(d, int))
    if all(isinstance(d, int) for d in shape):
        return known
    return lm_rule.AtLeast(known)


def _scoped_values(layer):
    """The values a stateless scope maps the head's weights to (a LoRA
    kernel, computed in the scope, as it is), or None outside one (the
    variables themselves are read then)."""
    scope = keras_internals.stateless_scope()
    if scope is None:
        return None
    weights = lm_head.head_of(layer)[1]
    values = tuple(
        scope.get_current_value(w) if isinstance(w, keras.Variable) else w for w in weights
    )
    return None if any(v is None for v in values) else values


def _metric_reading_logits(model):
    """The name of a compiled metric the chunks cannot compute, or None."""
    for metric, _ in keras_internals.compiled_metrics(model):
        if not isinstance(metric, lm_rule.CHUNKED_METRICS):
            return metric.name
    return None


class _Chunked:
    def __init__(self, model, found, facts):
        self.model, self.found, self.facts = model, found, facts
        self.swapped = []
        self.calls = []

    def _swap(self, owner, name, value):
        self.swapped.append((owner, name, owner.__dict__.get(name)))
        object.__setattr__(owner, name, value)

    def __enter__(self):
        model = self.model
        trunk = self.found.trunk

        def call(inputs, training=None, mask=None, **kwargs):
            # The head's weights as this call sees them: in a stateless
            # scope (JAX: `stateless_call`), the traced values, which a
            # step of the user's own that calls `compute_loss` outside the
            # scope (Keras's JAX guide) would not see in the variables;
            # kept with the call's output, whose loss reads them (a second
            # call, a teacher's weights, has its own).
            weights = _scoped_values(self.found.layer)
            hidden = trunk.call(inputs, training=training, mask=mask)
            if weights is not None:
                self.calls.append((hidden, weights))
            return hidden

        self._swap(model, "call", call)
        compile_loss = keras_internals.compile_loss(model)
        self._swap(compile_loss, "call", self._loss)
        compile_metrics = keras_internals.compile_metrics(model)
        if compile_metrics is not None:
            self._swap(compile_metrics, "update_state", lambda *args, **kwargs: None)
        return self

    def __exit__(self, *exc):
        self.calls = []
        for owner, name, before in reversed(self.swapped):
            if before is None:
                owner.__dict__.pop(name, None)
            else:
                object.__setattr__(owner, name, before)
        self.swapped = []

    def _loss(self, y_true, y_pred, sample_weight=None):
        """The compiled loss of the hidden states `y_pred`, through the head."""
        ignore_class, reduction = lm_rule.sparse_from_logits(self.facts.loss)
        head, weights = lm_head.head_of(self.found.layer)
        weights = self._weights_of(y_pred) or weights
        mask = keras_internals.get_keras_mask(y_pred) if self.found.passes_mask else None
        value, _, correct = lm_loss.sparse_cross_entropy(
            head,
            y_pred,
            weights,
            y_true,
            sample_weight=sample_weight,
            mask=mask,
            ignore_class=ignore_class,
            reduction=reduction,
            chunk=self.facts.chunk,
            dtype=self.facts.loss.dtype,
        )
        compile_loss = keras_internals.compile_loss(self.model)
        value = ops.cast(value, compile_loss.dtype)
        weight = keras_internals.single_loss_weight(compile_loss)
        if weight is not None:
            value = ops.multiply(value, weight)
        self._update_metrics(correct, sample_weight, mask)
        return value

    def _weights_of(self, hidden):
        """The head's weights the call that made `hidden` saw (the latest
        call's where `hidden` is not one's output), or None."""
        for output, weights in reversed(self.calls):
            if output is hidden:
                return weights
        return self.calls[-1][1] if self.calls else None

    def _say(self, words):
        decided = self.model.__dict__.get(_DECISION)
        if decided is not None and words not in decided[1]:
            decided = (decided[0], f"{decided[1]}; {words}") + decided[2:]
            object.__setattr__(self.model, _DECISION, decided)

    def _update_metrics(self, correct, sample_weight, mask):
        """The compiled accuracies from each token's argmax hit, weighted
        as Keras's `MeanMetricWrapper` weights them."""
        compiled = keras_internals.compiled_metrics(self.model)
        if compiled and backends.current.STATELESS and keras_internals.stateless_scope() is None:
            # A JAX train_step of the user's own calls `compute_loss`
            # inside its gradient's trace and outside any scope: the
            # metrics' values cannot leave it, and the logits are never
            # made for the user's own update. Said in the summary.
            self._say(METRICS_NOT_UPDATED)
            return
        if mask is not None:
            mask = ops.cast(mask, "float32")
        for metric, weighted in compiled:
            weight = sample_weight if weighted else None
            if mask is not None:
                weight = mask if weight is None else ops.cast(weight, "float32") * mask
            keras.metrics.Mean.update_state(metric, correct, sample_weight=weight)
