"""Families whose own arithmetic (not their projections) computes what
float16 cannot hold: NaN, or steps that never apply, under Keras's own
`mixed_float16`. At O1/O2 in float16 keras_mp's rules run that arithmetic in
float32 (the rule is named in `precision_summary`), and the family trains as
float32 does, step by step.

Which backend proves what (CI's time): the rules' decisions and the
arithmetic they keep in float32 (IEEE's: `0 * -inf` is NaN everywhere) are
the same Keras code on every backend; PyTorch (a second or two a step)
trains every family in every cell. TensorFlow compiles T5Gemma2's step at
O2 in float16, the cell the rule is for, where its dynamic scale backs off
on the first steps (its compiled skip, followed by float32's steps).
JAX's compiled float16 step, with float32 layers inside (norms, softmax),
is `test_levels`'s: compiling these families there costs 20-40 s each.
KerasHub's T5 is checked on TensorFlow, where Keras's own policy gives NaN
(PyTorch's masked sum stays finite).
"""

import numpy as np
import pytest

import keras_mp
from keras_mp._src import backends
from tests.zoo import families
from tests.zoo import runs
from tests.zoo.runs import BACKEND
from tests.zoo.runs import TORCH
from tests.zoo.runs import np64

pytestmark = pytest.mark.zoo


@pytest.mark.one_backend
def test_users_masked_attention_is_finite_where_keras_mixed_policy_is_not():
    """The tutorial's `logits += mask * -1e9` in a user's layer, in float16."""
    model, x, y, loss = runs.model("tutorial_attention")
    assert not np.isfinite(runs.keras_mixed_float16_outputs("tutorial_attention", x)).all()

    keras_mp.apply_amp(model, "O2", "float16")
    assert np.isfinite(np64(model(x))).all()
    assert "own arithmetic in float32" in runs.rule(model, "TutorialAttention")
    # Opting the block into float16 brings the NaN back: the rule is what fixes it.
    keras_mp.apply_amp(model, "O2", "float16", allow=[families.TutorialAttention])
    assert not np.isfinite(np64(model(x))).all()


@pytest.mark.one_backend("tensorflow")
def test_keras_hub_t5_is_finite_where_keras_mixed_policy_is_not():
    """KerasHub's T5 attention masks with `-1e9` in its compute dtype."""
    model, x, y, loss = runs.model("t5")
    assert not np.isfinite(runs.keras_mixed_float16_outputs("t5", x)).all()

    keras_mp.apply_amp(model, "O2", "float16")
    assert np.isfinite(np64(model(x))).all()
    assert "masks with -1e9" in runs.rule(model, "T5MultiHeadAttention")


# KerasHub families whose own arithmetic computes what float16 cannot hold:
# NaN under Keras's own `mixed_float16`. The layers that run their own
# arithmetic in float32 at O1/O2 in float16.
BEYOND_FLOAT16 = {
    # `(1 - mask) * -1e9` masks, added to the attention logits.
    "t5gemma": {"T5GemmaEncoderLayer", "T5GemmaDecoderLayer", "T5GemmaAttention"},
    "t5gemma2": {"T5Gemma2EncoderLayer", "T5Gemma2DecoderLayer", "T5Gemma2Attention"},
    # Keys normalized with an epsilon of 1e-12, 0 in float16.
    "rwkv7": {"RWKV7TimeMix"},
}
# The family TensorFlow trains at O2 in float16, compiled.
COMPILED = {"tensorflow": "t5gemma2"}
_COMPILED_SLOW = pytest.mark.slow(
    reason="TensorFlow compiles T5Gemma2's encoder-decoder step with XLA, and Keras's policy's"
)
_CELLS = [
    pytest.param(
        family,
        level,
        half,
        id=f"{family}-{level}-{half}",
        marks=() if TORCH else _COMPILED_SLOW,
    )
    for family in BEYOND_FLOAT16
    for level, half in (("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16"))
    if TORCH or (COMPILED.get(BACKEND) == family and (level, half) == ("O2", "float16"))
]


@pytest.mark.parametrize("family, level, half", _CELLS)
def test_keras_hub_families_train_where_keras_mixed_policy_gives_nan(family, level, half):
    """T5Gemma's and T5Gemma2's encoder and decoder layers build their
    attention masks as `(1 - mask) * -1e9` in their compute dtype, which
    their attention adds to the logits: in float16, `0 * -inf` is NaN, and a
    padded query past the sliding window has only `-inf` logits, whose
    softmax is NaN. RWKV-7's time mix normalizes its keys with an epsilon of
    1e-12, 0 in float16: a padded token's zeroed keys give `0 * inf`. Under
    Keras's own `mixed_float16` their outputs are NaN. At O1/O2 in float16
    those layers run their own arithmetic in float32 (their projections,
    MLPs and norms as the level says), and the model trains as float32
    does, step by step. (O3 in float16 is half everywhere, NaN as under
    Keras's own float16 policy.)"""
    _, x, _, _ = runs.model(family)
    keras_outputs = runs.keras_mixed_float16_outputs(family, x)
    # On a CPU; a GPU's kernels may keep Keras's outputs finite (PyTorch's
    # on an H100 did): keras_mp must train either way.
    assert not np.isfinite(keras_outputs).all() or backends.current.gpu_compute_capability()

    model, x, y, loss = runs.model(family)
    keras_mp.apply_amp(model, level, half)
    if half == "float16":
        rows = keras_mp.precision_summary(model).rows
        in_float32 = {r["class"] for r in rows if "own arithmetic in float32" in r["rule"]}
        # O1: the layers are float32 anyway (not on the allow-list).
        assert level == "O1" or BEYOND_FLOAT16[family] <= in_float32
    # In float16 the dynamic scale may back off from 2**15 on the first steps
    # (T5Gemma2's do, with its head in float16): those steps apply nothing.
    runs.trains_as_float32_does(family, level, half)


@pytest.mark.one_backend
def test_keras_hub_qwen3_5_trains_in_float16_where_keras_mixed_policy_does_not():
    """Qwen3.5's gated delta net L2-normalizes its queries and keys in its own
    code, `x * rsqrt(sum(x**2) + 1e-6)`: for a short key the gradient of
    rsqrt is inf in float16 whatever the loss scale. With this tiny model's
    PyTorch weights, every step of Keras's own `mixed_float16` overflows
    and the model does not train. At O2 the layer's own arithmetic is
    float32 (its projections half): no step is skipped, and it trains as
    float32 does. (Its chunked recurrence costs 50 s to trace and compile on
    a CPU; the rule and its arithmetic are the same Keras code on every
    backend.)"""
    import keras

    _, x, y, loss = runs.model("qwen3_5")
    keras_model = runs.built_under_keras_mixed_float16("qwen3_5")
    keras_model.compile(optimizer=keras.optimizers.Adam(runs.LEARNING_RATE), loss=loss)
    before = [np64(v) for v in keras_model.trainable_variables]
    keras_model.fit(x, y, batch_size=runs.batch(x), epochs=runs.STEPS, verbose=0)
    assert all(np.array_equal(np64(v), b) for v, b in zip(keras_model.trainable_variables, before))

    model, x, y, loss = runs.model("qwen3_5")
    keras_mp.apply_amp(model, "O2", "float16")
    assert "rsqrt's gradient overflows float16" in runs.rule(model, "Qwen3_5GatedDeltaNet")
    _, _, skipped = runs.trains_as_float32_does("qwen3_5", "O2", "float16")
    assert skipped == 0
