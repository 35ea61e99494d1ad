"""Which layer computes in which dtype: the precision rules, as a table.

`RULES` is read top to bottom; the first row whose conditions all hold for a
layer gives its policy and the reason `precision_summary` shows. A row is
data: conditions (a layer class matched with `isinstance`, or a property of
the layer, of where it sits, or of the level), a policy, a reason. As in
PyTorch's autocast lists and MindSpore's white and black lists, the level is
a choice of rows, and a rule for a new model family is one row (and one
test): `docs/design.md`, "Adding a rule". The kinds of layer the rows ask
about, and the lists, are `layer_kinds.py`.

Policies: `FLOAT32`; `MIXED` (half compute, float32 variables); `HALF` (half
compute and variables, O3); `LEVEL_HALF` (`MIXED` at O2, `HALF` at O3);
`FLOAT8` (`LEVEL_HALF` around an FP8 matmul, `float8.py`); `CONTAINER` (a
nested model's policy: it casts its inputs); `KEEP` (the layer's own policy
stays). `{level}` in a reason is the level's name; `{policy}` and
`{compute}` the layer's own.
"""

import dataclasses

import keras

from keras_mp._src.backends import fp8
from keras_mp._src.precision import float8
from keras_mp._src.precision import lm_rule
from keras_mp._src.precision import output_losses
from keras_mp._src.precision.conditions import Place  # noqa: F401
from keras_mp._src.precision.conditions import attention_needs_float32_here
from keras_mp._src.precision.conditions import computes
from keras_mp._src.precision.conditions import denied
from keras_mp._src.precision.conditions import frozen
from keras_mp._src.precision.conditions import in_float8
from keras_mp._src.precision.conditions import in_float16_at
from keras_mp._src.precision.conditions import inside_allowed
from keras_mp._src.precision.conditions import is_container
from keras_mp._src.precision.conditions import is_first
from keras_mp._src.precision.conditions import is_head
from keras_mp._src.precision.conditions import is_model_io
from keras_mp._src.precision.conditions import is_output
from keras_mp._src.precision.conditions import keep_batchnorm_fp32
from keras_mp._src.precision.conditions import layer_is
from keras_mp._src.precision.conditions import may_overflow_float16
from keras_mp._src.precision.conditions import not_denied
from keras_mp._src.precision.conditions import not_user_allowed
from keras_mp._src.precision.conditions import on_allow_list
from keras_mp._src.precision.conditions import own_arithmetic_in_float32
from keras_mp._src.precision.conditions import router
from keras_mp._src.precision.conditions import user_denied
from keras_mp._src.precision.layer_kinds import EPS_1E12
from keras_mp._src.precision.layer_kinds import EXACT_PREPROCESSING
from keras_mp._src.precision.layer_kinds import MASKS_WITH_1E9
from keras_mp._src.precision.layer_kinds import OWN_L2_NORM
from keras_mp._src.precision.layer_kinds import computes_no_float
from keras_mp._src.precision.layer_kinds import computes_probabilities
from keras_mp._src.precision.layer_kinds import of_class
from keras_mp._src.precision.layer_kinds import quantized
from keras_mp._src.precision.layer_kinds import routes_experts
from keras_mp._src.precision.layer_kinds import runs_users_code
from keras_mp._src.precision.layer_kinds import warn_jax_cpu_attention_once
from keras_mp._src.precision.levels import Compute

# -- the policies a row gives ---------------------------------------------------

FLOAT32 = "float32"
MIXED = "mixed"
HALF = "half"
LEVEL_HALF = "level half"
FLOAT8 = "float8"
CONTAINER = "container"
KEEP = "keep"


# -- the table ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row: when all of `when` hold, the layer gets `policy`, for `reason`.

    `note`: called with the layer when the row applies (a one-time warning).
    """

    when: tuple
    policy: str
    reason: str
    note: object = None


_O1_O2 = (Compute.ALLOW, Compute.DENY)

# Kept at every level, whatever the level or the layer's place: another
# policy would change what they compute (`to_float` and a loaded model's
# saved precision ask these rows too, `kept_reason`).
KEPT = (
    Rule((layer_is(quantized),), KEEP, "quantized ({policy}): kept"),
    Rule((layer_is(computes_no_float),), KEEP, "{compute} outputs: kept"),
)

# FP8 (`amp_dtype="float8"`, O2, O3): Keras's float8 Dense and EinsumDense
# but the first and output layers (Transformer Engine's recipes keep them in
# higher precision), GEMMs FP8 cannot run and GEMMs too small for FP8 to
# pay (`Float8Recipe.small_gemm`); `allow=` puts those in FP8.
_FP8 = (in_float8, layer_is(float8.has_float8_path))
_FP8_REASON = "{level} float8: " + fp8.matmul_words()


def _too_small(layer, place):
    return float8.too_small(layer, place.amp.float8) is not None


def _size_unknown(layer, place):
    return float8.size_unknown(layer, place.amp.float8)


def _fp8_in_bfloat16(condition, reason):
    return Rule(_FP8 + (condition, not_user_allowed), LEVEL_HALF, "{level} float8: " + reason)


FLOAT8_RULES = (
    # Keras's float8 layers move their scales only through the optimizer: a
    # frozen one would compute with scales stuck where they started.
    Rule(
        _FP8 + (frozen,),
        LEVEL_HALF,
        "{level} float8: frozen (FP8 scales move only in training), bfloat16",
    ),
    _fp8_in_bfloat16(is_head, "output layer in bfloat16 (allow= for FP8)"),
    _fp8_in_bfloat16(is_first, "first layer in bfloat16 (allow= for FP8)"),
    _fp8_in_bfloat16(layer_is(float8.misaligned), "{misaligned} not a multiple of 16, bfloat16"),
    _fp8_in_bfloat16(
        _size_unknown, "unbuilt: bfloat16 until built, then its GEMM's size decides (small_gemm)"
    ),
    _fp8_in_bfloat16(_too_small, "{small} too small for FP8 to pay (small_gemm), bfloat16"),
    Rule(_FP8, FLOAT8, _FP8_REASON),
)
# A layer FP8 already (a model saved at this level, loaded): kept under
# FP8's reason (Keras cannot undo a quantization); frozen since, its input
# scale follows the amax of each training step's inputs
# (`float8.set_call`).
KEPT_FP8 = (
    Rule(
        (in_float8, layer_is(float8.is_float8), frozen),
        KEEP,
        "{level} float8: frozen after FP8 training, its input scale follows each step's amax",
    ),
    Rule((in_float8, layer_is(float8.is_float8)), KEEP, _FP8_REASON),
)

RULES = KEPT_FP8 + KEPT
RULES += (
    # The model's structure.
    Rule((is_model_io,), FLOAT32, "{level}: model, float32 inputs and outputs"),
    # A nested model named in `deny=` is float32 through and through (an
    # EMA copy of a network that its `train_step` assigns to).
    Rule((is_container, user_denied), FLOAT32, "{level}: deny=, float32"),
    Rule((is_container,), CONTAINER, "{level}: container"),
    # A model's other output layers compute as their level says and return
    # float32 (`boundaries.py`). Probabilities are float32 wherever they are
    # computed (`probabilities.py`): a layer that is nothing but a softmax or
    # sigmoid has no matmul to gain.
    Rule(
        (layer_is(computes_probabilities), not_user_allowed),
        FLOAT32,
        "probabilities in float32",
    ),
    # Exact at every level.
    Rule(
        (layer_is(of_class(*EXACT_PREPROCESSING)),),
        FLOAT32,
        "indices, counts and bins: float32 at every level",
    ),
    # Fixed statistics (`adapt`ed, not trained), converted to the compute
    # dtype when built: in half they would change on every reload.
    Rule(
        (layer_is(of_class(keras.layers.Normalization)),),
        FLOAT32,
        "input statistics: float32 at every level",
    ),
    Rule((computes(Compute.NONE),), FLOAT32, "{level}: float32"),
    # The user's `deny=` wins at every level, over the allow-list too.
    Rule((user_denied,), FLOAT32, "{level}: deny=, float32"),
    # What float16 cannot hold (above); `allow=` overrides.
    Rule(
        (in_float16_at(*_O1_O2), layer_is(MASKS_WITH_1E9), not_user_allowed),
        FLOAT32,
        "{level}: masks with -1e9, own arithmetic in float32",
    ),
    Rule(
        (in_float16_at(*_O1_O2), layer_is(EPS_1E12), not_user_allowed),
        FLOAT32,
        "{level}: normalizes with eps 1e-12 (0 in float16), own arithmetic in float32",
    ),
    Rule(
        (in_float16_at(*_O1_O2), layer_is(OWN_L2_NORM), not_user_allowed),
        FLOAT32,
        "{level}: L2-normalizes in its own code (rsqrt's gradient overflows float16), "
        "own arithmetic in float32",
    ),
    Rule(
        (attention_needs_float32_here,),
        FLOAT32,
        "{level}: attention on JAX's CPU, float32 (no float16 dot there)",
        note=warn_jax_cpu_attention_once,
    ),
    # Mixture of experts: the router, and the routing, in float32.
    Rule((router, not_user_allowed), FLOAT32, "{level}: expert router, float32"),
    Rule(
        (computes(Compute.DENY, Compute.ALL), layer_is(routes_experts), not_user_allowed),
        FLOAT32,
        "{level}: expert routing in float32 (experts in half)",
    ),
    # An output layer of the user's own code (a VAE's Sampling): as before
    # the output rule, float32, no fallback to warn of; `allow=` for half.
    Rule(
        (is_output, layer_is(runs_users_code), not_user_allowed),
        FLOAT32,
        "model output: your layer, float32 (allow= for half)",
    ),
    # An output float16 could overflow (`output_losses.py`): a language
    # model's head (a cross-entropy's logits) and bfloat16's stay in half.
    Rule(
        (may_overflow_float16, not_user_allowed),
        FLOAT32,
        "model output ({loss}): float16 could overflow it, float32 (bfloat16 or allow= for half)",
    ),
    # A composite layer of the user's, at O2 in float16.
    Rule(
        (own_arithmetic_in_float32,),
        FLOAT32,
        "{level}: own arithmetic in float32 (your layer; allow= for half)",
    ),
    # O1: the allow-list, and what is inside it but for the deny-list.
    Rule((computes(Compute.ALLOW), on_allow_list), MIXED, "{level} allow-list"),
    Rule(
        (computes(Compute.ALLOW), inside_allowed, not_denied),
        MIXED,
        "{level}: inside an allow-listed layer",
    ),
    Rule((computes(Compute.ALLOW), inside_allowed), FLOAT32, "{level} deny-list"),
    Rule((computes(Compute.ALLOW),), FLOAT32, "{level}: not on the allow-list"),
    # O2: all but the deny-list.
    Rule((computes(Compute.DENY), denied), FLOAT32, "{level} deny-list"),
)
# FP8's choice of matmuls, before the levels' half rows.
RULES += FLOAT8_RULES + (
    Rule((computes(Compute.DENY),), MIXED, "{level}: half compute, float32 variables"),
    # O3: everything.
    Rule((keep_batchnorm_fp32,), FLOAT32, "{level}: keep_batchnorm_fp32=True"),
    Rule((), HALF, "{level}: half everywhere"),
)


# A language model's loss (`lm_loss.py`), decided when `fit`'s step is
# traced (`lm_rule.LossFacts`): chunk by chunk, or the plain loss.
CHUNKED = "chunked"
PLAIN = "plain"
_OFF = "chunked_loss=False for the plain loss"
LOSS_RULES = (
    Rule((lm_rule.turned_off,), PLAIN, "plain loss: chunked_loss=False"),
    Rule(
        (lm_rule.not_sparse_from_logits,),
        PLAIN,
        "plain loss: {loss} is not SparseCategoricalCrossentropy(from_logits=True)",
    ),
    Rule((lm_rule.no_head,), PLAIN, "plain loss: {why}"),
    Rule(
        (lm_rule.metric_reads_logits,),
        PLAIN,
        "plain loss: metric `{metric}` reads the logits "
        "(SparseCategoricalAccuracy is computed chunk by chunk, no other)",
    ),
    Rule(
        (lm_rule.by_rule, lm_rule.own_train_step),
        PLAIN,
        "plain loss: your train_step may read the logits "
        "(chunked_loss=True chunks its compute_loss)",
    ),
    Rule(
        (lm_rule.by_rule, lm_rule.small_logits),
        PLAIN,
        "plain loss: logits of {tokens} tokens x {vocabulary} under {threshold} elements",
    ),
    Rule(
        (),
        CHUNKED,
        "float32 loss chunk by chunk through `{head}` ({chunk} tokens a chunk, "
        "{tokens} tokens x {vocabulary}): never the whole logits; " + _OFF,
    ),
)


def decide_loss(facts):
    """`(chunked, reason)` for a model's loss: the first row of
    `LOSS_RULES` that holds for its `lm_rule.LossFacts`."""
    rule = first_rule(facts.found.layer, facts, LOSS_RULES)
    return rule.policy == CHUNKED, rule.reason.format(**facts.reason_fields())


def decide(layer, place, rules=RULES):
    """(policy name or None, reason) for `layer`: the first row that holds.

    None keeps the layer's own policy (`KEEP`).
    """
    rule = first_rule(layer, place, rules)
    if rule.note is not None:
        rule.note(layer)
    reason = _reason(rule.reason, layer, place.amp, output_losses.describe(place.loss))
    return _policy(rule.policy, place.amp), reason


def first_rule(layer, place, rules=RULES):
    """The row of `rules` that decides for `layer`."""
    for rule in rules:
        if all(condition(layer, place) for condition in rule.when):
            return rule
    raise AssertionError("the last rule holds for every layer")  # pragma: no cover


def kept_reason(layer):
    """Why `layer` keeps its own policy at every level, or None."""
    for rule in KEPT:
        if all(condition(layer, None) for condition in rule.when):
            return _reason(rule.reason, layer, None)
    return None


def _policy(policy, amp):
    """The policy's name, or Keras's float8 policy object for `FLOAT8`."""
    level_half = amp.half if amp.compute is Compute.ALL else amp.mixed
    if policy == FLOAT8:
        return float8.policy(level_half, amp.float8)
    return {
        FLOAT32: "float32",
        MIXED: amp.mixed,
        HALF: amp.half,
        LEVEL_HALF: level_half,
        CONTAINER: amp.container_policy,
        KEEP: None,
    }[policy]


def _reason(reason, layer, amp, loss=""):
    return reason.format(
        level=getattr(amp, "name", ""),
        loss=loss,
        policy=layer.dtype_policy.name,
        compute=keras.backend.standardize_dtype(layer.compute_dtype),
        misaligned=float8.misaligned(layer) if "{misaligned}" in reason else "",
        small=float8.too_small(layer, amp.float8) if "{small}" in reason else "",
    )
