"""The facts the chunked-loss rule asks about (`rules.LOSS_RULES`), and its
conditions.

Whether `fit`'s step computes a language model's loss chunk by chunk
(`lm_loss.py`) is decided when the step is traced (run, on PyTorch), when
the batch's shapes and the compiled metrics are known: a row of
`rules.LOSS_RULES`, read top to bottom as the layer rules are, each
condition a function of `(head layer, LossFacts)`.
"""

import dataclasses

import keras

from keras_mp._src.precision import lm_head
from keras_mp._src.precision import lm_loss

# Logits (tokens x vocabulary) from which on the rule chunks the loss: at
# least two chunks' worth (256 MiB of float32 logits, which Keras's loss
# holds beside their half copy and their gradient).
LOGITS_THRESHOLD = 2 * lm_loss.CHUNK_LOGITS

# Metrics computed from each chunk's logits in the same pass (argmax hits).
CHUNKED_METRICS = (keras.metrics.SparseCategoricalAccuracy,)


class AtLeast(int):
    """A token count whose batch dimension is not known when traced: the
    known dimensions' product, a lower bound (a batch of at least one)."""


@dataclasses.dataclass(frozen=True)
class LossFacts:
    """What the rule asks of a compiled model and its batch.

    Attributes:
        setting: `compile`'s `chunked_loss`: None (by rule), True, False,
            or the tokens a chunk takes (on).
        found: `lm_head.Found` (the head and trunk, or why there is none).
        loss: the loss `compile` was given.
        metric: the name of a compiled metric that reads the logits, or None.
        own_step: whether the model's `train_step` is its own.
        tokens: the batch's tokens (`AtLeast` the known dimensions' where
            one is not known when traced; None: no shape).
    """

    setting: object
    found: object
    loss: object
    metric: str = None
    own_step: bool = False
    tokens: object = None

    @property
    def vocabulary(self):
        return lm_head.vocabulary_of(self.found.layer)

    @property
    def chunk(self):
        if isinstance(self.setting, int) and not isinstance(self.setting, bool):
            return self.setting
        return lm_loss.chunk_tokens(self.vocabulary)

    def reason_fields(self):
        fields = {"why": self.found.why, "metric": self.metric, "setting": self.setting}
        fields["loss"] = _describe(self.loss)
        if self.found.layer is not None:
            tokens = "?" if self.tokens is None else f"{self.tokens:,}"
            if isinstance(self.tokens, AtLeast):
                tokens = f"at least {int(self.tokens):,}"
            fields.update(
                head=self.found.layer.name,
                chunk=self.chunk,
                tokens=tokens,
                vocabulary=f"{self.vocabulary:,}",
                threshold=f"{LOGITS_THRESHOLD:,}",
            )
        return fields


def sparse_from_logits(loss):
    """`(ignore_class, reduction)` of a `SparseCategoricalCrossentropy(
    from_logits=True)`, else None."""
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return None
    config = loss.get_config()
    if not config.get("from_logits") or config.get("axis", -1) != -1:
        return None
    return config.get("ignore_class"), config.get("reduction", "sum_over_batch_size")


def _describe(loss):
    if isinstance(loss, keras.losses.Loss):
        return type(loss).__name__
    return repr(loss)


# -- conditions: (head layer, facts) -> bool ----------------------------------------


def turned_off(_, facts):
    return facts.setting is False


def no_head(_, facts):
    return facts.found.layer is None


def not_sparse_from_logits(_, facts):
    return sparse_from_logits(facts.loss) is None


def metric_reads_logits(_, facts):
    return facts.metric is not None


def by_rule(_, facts):
    return facts.setting is None


def own_train_step(_, facts):
    return facts.own_step


def small_logits(_, facts):
    # A batch dimension not known when traced (`AtLeast`): not known small
    # (TensorFlow's `tf.data` batches without `drop_remainder`).
    if facts.tokens is None or isinstance(facts.tokens, AtLeast):
        return False
    return facts.tokens * facts.vocabulary < LOGITS_THRESHOLD
