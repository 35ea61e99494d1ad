"""The model zoo: real model families train at every level, on every backend.

Each family (KerasHub backbones and tasks, keras.applications CNNs, a masked
LSTM/GRU, a two-output model, a user's masked attention block) is built in a
tiny configuration with random weights and trained a few steps at O1, O2 and
O3, in float16 and bfloat16, through `compile(amp_level=...)` and `fit`.

The reference is the same model in float32: before training, the model at
each level must give the float32 model's outputs within the half dtype's
tolerance; after `fit`, the loss is finite, the outputs are float32, and the
variables and normalisations are in the dtypes the level says.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src import backends
from tests.zoo import families

pytestmark = pytest.mark.zoo

BACKEND = keras.backend.backend()
HALF = ("float16", "bfloat16")
LEVELS = ("O1", "O2", "O3")
# Relative tolerance of the outputs at a level against float32, before any
# training: about 2**-8 (float16) and 2**-5 (bfloat16) per value, grown over
# a few layers; O3 also rounds the weights.
TOLERANCE = {
    ("O1", "float16"): 0.02,
    ("O2", "float16"): 0.02,
    ("O3", "float16"): 0.05,
    ("O1", "bfloat16"): 0.1,
    ("O2", "bfloat16"): 0.1,
    ("O3", "bfloat16"): 0.25,
}
# An output's error against float32's, over how much float32's outputs vary
# from input to input (measured at most 0.055 in float16 and 0.48 in
# bfloat16, T5's at O3; an output that ignores its input scores about 1).
SPREAD = {"float16": 0.25, "bfloat16": 0.75}
# Mixture-of-experts models: their outputs are compared token by token.
ROUTED = {"mixtral"}
# keras.applications CNNs: their compiled `fit` costs 15-20 s to trace or
# compile per case on a CPU, against 2-3 s for an eager one. They run the
# level x dtype matrix with `run_eagerly=True` (the same layers, policies
# and casts, op by op) and one compiled `fit` each, at O2 in float16
# (`test_application_trains_compiled`). `-m "not heavy"` leaves them out
# locally; CI runs them.
HEAVY = set(families.APPLICATIONS)
# The cells a family's `fit` is compiled in (graph on TensorFlow, XLA on
# JAX): one per level and at least one per dtype; the others run eagerly
# (the policies and casts are the same, and compiling costs 3-10 s a cell).
COMPILED = {("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")}
# Which backend proves what (CI's time). The levels' policies and casts are
# the same Keras code on every backend; a backend adds its own step and, on
# TensorFlow and JAX, its compiled program. PyTorch runs a family's step op by
# op in 1-3 s a cell: it trains each family in the COMPILED cells and one of
# the three eager cells, taken in turn, and each keras.applications CNN in two
# cells in turn. TensorFlow and JAX compile `fit` (a graph, XLA) in 6-55 s a
# cell on a CPU: there each family trains in one of the COMPILED cells, taken
# in turn, so that every compiled cell is compiled by several families;
# TensorFlow also runs one eager cell in turn (1-3 s), and each
# keras.applications CNN eagerly in one cell in turn, its compiled `fit` in
# `test_application_trains_compiled`. JAX runs an eager `fit` op by op, each
# op compiled on its first call (30-90 s a cell for a keras.applications
# CNN): each keras.applications CNN trains there in its one compiled cell
# (35-55 s a cell to compile).
JAX = BACKEND == "jax"
TORCH = BACKEND == "torch"


def _turn(family):
    return list(families.FAMILIES).index(family)


def _compiled_cell(family):
    """The one COMPILED cell a family trains in on TensorFlow and JAX."""
    return sorted(COMPILED)[_turn(family) % len(COMPILED)]


def _jax_cells(family):
    return {_compiled_cell(family)}


def _cells(family):
    """The cells a family trains in on TensorFlow and PyTorch."""
    turn = _turn(family)
    every = sorted((level, half) for level in LEVELS for half in HALF)
    eager = sorted(set(every) - COMPILED)
    if family in HEAVY:
        cells = {every[(2 * turn) % len(every)], every[(2 * turn + 1) % len(every)]}
        return cells if TORCH else {every[turn % len(every)]}
    compiled = COMPILED if TORCH else {_compiled_cell(family)}
    return compiled | {eager[turn % len(eager)]}


def _np(x):
    return keras.ops.convert_to_numpy(x).astype("float64")


def _outputs(model, x):
    """The model's outputs on `x`, flattened: one compiled `predict` on JAX
    (an eager call compiles each op on its first use), a call elsewhere."""
    if JAX:
        return keras.tree.flatten(model.predict(x, batch_size=len(x), verbose=0))
    return keras.tree.flatten(model(x, training=False))


_FLOAT32_OUTPUTS = {}


def _float32_outputs(family, model, x):
    """The float32 model's outputs, once per family and process: `_build`
    gives the same weights every time (seed 0)."""
    if family not in _FLOAT32_OUTPUTS:
        _FLOAT32_OUTPUTS[family] = [_np(o) for o in _outputs(model, x)]
    return _FLOAT32_OUTPUTS[family]


def _has_batchnorm(model):
    return any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in model._flatten_layers(include_self=False)
    )


def _build(family):
    """A family of `families` (of its level matrix or not), seed 0, float32."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    return getattr(families, family)()


def _cases():
    for family in families.FAMILIES:
        marks = [pytest.mark.heavy] if family in HEAVY else []
        for level in LEVELS:
            for half in HALF:
                if JAX and (level, half) not in _jax_cells(family):
                    continue
                if not JAX and (level, half) not in _cells(family):
                    continue
                if family in ("tutorial_attention", "t5") and level == "O3":
                    # O3 is half everywhere, the attention's own arithmetic
                    # too: its -1e9 mask is NaN in float16 there, as under
                    # Keras's own float16 policy (bfloat16 has float32's range).
                    if half == "float16":
                        continue
                yield pytest.param(family, level, half, marks=marks, id=f"{family}-{level}-{half}")


def _optimizer(level, half):
    # Adam at every level: at O3 its moments live beside float32 master
    # weights (in float16 or bfloat16 they would underflow, overflow or
    # round every update away).
    return keras.optimizers.Adam(1e-3)


def _compile(model, loss, level, half, **kwargs):
    kwargs.setdefault("run_eagerly", False)
    if level == "O3" and half == "float16":
        # O3 has no loss scaling by default (Apex's speed baseline): with
        # float16 everywhere, CNNs at random init overflow (NaN under Keras's
        # own float16 policy too). Opting in skips those steps.
        kwargs.setdefault("loss_scale", "dynamic")
    keep_bn = True if level == "O3" and _has_batchnorm(model) else None
    model.compile(
        optimizer=_optimizer(level, half),
        loss=loss,
        amp_level=level,
        amp_dtype=half,
        keep_batchnorm_fp32=keep_bn,
        **kwargs,
    )


def _fit_kwargs(family, x, y):
    if family == "two_outputs":
        return {"sample_weight": np.linspace(0.5, 1.5, len(x)).astype("float32")}
    return {}


# Each family goes through a `.keras` file at each level once, in the dtype
# below (on JAX, in the one cell it trains in).
ROUND_TRIP_DTYPE = {"O1": "float16", "O2": "float16", "O3": "bfloat16"}


def _assert_round_trip(model, x, path):
    """Saved and loaded: the same outputs bit for bit, the same precision per
    layer, the same optimizer state (KerasHub's tasks too, whose `compile`
    Keras skips at load, and whose constructor makes an optimizer)."""
    before = [_np(o) for o in _outputs(model, x)]
    model.save(path)
    loaded = keras.models.load_model(path)
    after = [_np(o) for o in _outputs(loaded, x)]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    assert [v.dtype for v in loaded.weights] == [v.dtype for v in model.weights]
    assert [r["compute_dtype"] for r in keras_mp.precision_summary(loaded).rows] == [
        r["compute_dtype"] for r in keras_mp.precision_summary(model).rows
    ]
    assert loaded.get_compile_config()["amp_level"] == model.get_compile_config()["amp_level"]
    assert type(loaded.optimizer) is type(model.optimizer)
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(_np(got), _np(want), err_msg=want.path)


@pytest.mark.parametrize("family, level, half", list(_cases()))
def test_family_trains_at_level(family, level, half, tmp_path):
    model, x, y, loss = _build(family)
    reference = _float32_outputs(family, model, x)

    extra = {"loss_weights": {"label": 1.0, "value": 0.5}} if family == "two_outputs" else {}
    eager = not JAX and (family in HEAVY or (level, half) not in COMPILED)
    _compile(model, loss, level, half, run_eagerly=eager, **extra)

    # Before training: the level's outputs are the float32 model's, within
    # the half dtype's tolerance, and float32; and they vary from input to
    # input as the float32 model's do (`SPREAD`: an output that ignores its
    # input, a constant 1/3, is as far from them as they are from their mean).
    outputs = _outputs(model, x)
    tolerance = TOLERANCE[(level, half)]
    for out, ref in zip(outputs, reference):
        assert keras.backend.standardize_dtype(out.dtype) == "float32"
        error = np.abs(_np(out) - ref)
        bound = tolerance * (1.0 + np.max(np.abs(ref)))
        if family in ROUTED:
            # Top-k routing: where two experts' logits nearly tie, rounding
            # upstream picks the other expert for that token.
            rerouted = np.mean(error.max(axis=-1) > bound)
            assert rerouted <= 0.05, (family, rerouted)
        else:
            assert np.max(error) <= bound, (family, np.max(error))
            spread = np.linalg.norm(ref - ref.mean(axis=0))
            if spread > 1e-6 * np.linalg.norm(ref):  # (a CNN at init may give one output)
                ratio = np.linalg.norm(_np(out) - ref) / spread
                assert ratio <= SPREAD[half], (family, ratio)

    before = [_np(v).copy() for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0, **_fit_kwargs(family, x, y))
    assert np.isfinite(history.history["loss"]).all(), history.history
    # It trained: the steps were applied. In float16 the dynamic scale starts
    # at 2**15 and halves at each overflowing step, which is skipped: a few
    # more epochs where every step so far was skipped, until one applies.
    for _ in range(6):
        moved = [not np.array_equal(b, _np(v)) for b, v in zip(before, model.trainable_variables)]
        if np.mean(moved) >= 0.5:
            break
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, **_fit_kwargs(family, x, y))
    assert np.mean(moved) >= 0.5, (family, f"{sum(moved)} of {len(moved)} variables moved")

    outputs = _outputs(model, x)
    for out in outputs:
        assert keras.backend.standardize_dtype(out.dtype) == "float32"
        assert np.isfinite(_np(out)).all()

    summary = keras_mp.precision_summary(model)
    for row in summary.rows:
        layer_class = row["class"]
        if level in ("O1", "O2") and layer_class.endswith(("Norm", "Normalization")):
            assert row["compute_dtype"] == "float32", row
        if level in ("O1", "O2") and layer_class == "Softmax":
            assert row["compute_dtype"] == "float32", row
    for variable in model.trainable_variables:
        if level in ("O1", "O2"):
            assert variable.dtype == "float32", variable.path
    if level == "O3":
        dtypes = {v.dtype for v in model.trainable_variables}
        assert half in dtypes, dtypes
    if JAX or ROUND_TRIP_DTYPE[level] == half:
        _assert_round_trip(model, x, tmp_path / f"{family}.keras")


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(HEAVY))
def test_application_trains_compiled(family):
    if JAX:
        pytest.skip("on JAX the level matrix compiles fit")
    model, x, y, loss = _build(family)
    _compile(model, loss, "O2", "float16")
    before = [np.array(w) for w in model.trainable_weights]
    steps = 3 * len(x)
    history = model.fit(x, y, batch_size=1, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # The dynamic scale starts at 2**15 and backs off on the first steps (as
    # Keras's mixed_float16 with its own LossScaleOptimizer does, scale for
    # scale, on these CNNs at random init), then steps are applied.
    skipped = history.history["skipped_steps"][-1]
    assert skipped < steps
    assert history.history["loss_scale"][-1] == 2.0**15 / 2**skipped
    after = [np.array(w) for w in model.trainable_weights]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def _quantized_policies(model):
    return {
        layer.path: layer.dtype_policy.name
        for layer in model._flatten_layers()
        if layer.dtype_policy.quantization_mode is not None
    }


@pytest.mark.parametrize(
    "form",
    [
        # JAX compiles the BERT's fit in each form (20-35 s on a CPU): the
        # int8 one there, whose quantized layers are the harder case.
        pytest.param("dtype_argument", marks=pytest.mark.skipif(JAX, reason="CI time on JAX")),
        "int8",
    ],
)
def test_keras_hub_model_with_its_own_dtype_trains_at_a_level(form):
    """A KerasHub model built in bfloat16 (what `from_preset(..., dtype=)`
    does) or quantized to int8, then compiled with `amp_level="O2"`: the level
    decides the float layers (float32 variables, float16 compute), quantized
    layers keep their policy, and the model trains."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    model, x, y, loss = families.bert(dtype="bfloat16" if form == "dtype_argument" else None)
    if form == "int8":
        model.backbone.quantize("int8")
        assert _quantized_policies(model)
    else:
        assert {v.dtype for v in model.trainable_variables} == {"bfloat16"}
    quantized = _quantized_policies(model)
    reference = _np(model(x, training=False))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=loss, amp_level="O2", run_eagerly=not JAX
    )
    assert _quantized_policies(model) == quantized
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    out = model(x, training=False)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(_np(out), reference, atol=0.1 * (1 + np.abs(reference).max()))
    before = [_np(v) for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["skipped_steps"][-1] <= 1
    after = [_np(v) for v in model.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def _built_under_keras_mixed_float16(family):
    """The family's model (the same weights as `_build`'s) under Keras's own
    `mixed_float16` policy."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        keras_model, _, _, _ = getattr(families, family)()
        return keras_model
    finally:
        keras.config.set_dtype_policy("float32")


def _keras_mixed_float16_outputs(family, x):
    """The family's outputs under Keras's own `mixed_float16` policy."""
    return _np(_built_under_keras_mixed_float16(family)(x))


def _rule(model, layer_class):
    return {r["class"]: r["rule"] for r in keras_mp.precision_summary(model).rows}[layer_class]


def test_users_masked_attention_is_finite_where_keras_mixed_policy_is_not():
    """The tutorial's `logits += mask * -1e9` in a user's layer, in float16."""
    model, x, y, loss = _build("tutorial_attention")
    assert not np.isfinite(_keras_mixed_float16_outputs("tutorial_attention", x)).all()

    keras_mp.apply_amp(model, "O2", "float16")
    assert np.isfinite(_np(model(x))).all()
    assert "own arithmetic in float32" in _rule(model, "TutorialAttention")
    # Opting the block into float16 brings the NaN back: the rule is what fixes it.
    keras_mp.apply_amp(model, "O2", "float16", allow=[families.TutorialAttention])
    assert not np.isfinite(_np(model(x))).all()


def test_keras_hub_t5_is_finite_where_keras_mixed_policy_is_not():
    """KerasHub's T5 attention masks with `-1e9` in its compute dtype."""
    model, x, y, loss = _build("t5")
    if BACKEND != "torch":  # PyTorch's masked sum stays finite there
        assert not np.isfinite(_keras_mixed_float16_outputs("t5", x)).all()

    keras_mp.apply_amp(model, "O2", "float16")
    assert np.isfinite(_np(model(x))).all()
    assert "masks with -1e9" in _rule(model, "T5MultiHeadAttention")


# KerasHub families whose own arithmetic (not their projections) computes
# what float16 cannot hold: NaN under Keras's own `mixed_float16`. The
# layers that run their own arithmetic in float32 at O1/O2 in float16.
BEYOND_FLOAT16 = {
    # `(1 - mask) * -1e9` masks, added to the attention logits.
    "t5gemma": {"T5GemmaEncoderLayer", "T5GemmaDecoderLayer", "T5GemmaAttention"},
    "t5gemma2": {"T5Gemma2EncoderLayer", "T5Gemma2DecoderLayer", "T5Gemma2Attention"},
    # Keys normalized with an epsilon of 1e-12, 0 in float16.
    "rwkv7": {"RWKV7TimeMix"},
}
_BEYOND_FLOAT16_CELLS = [
    pytest.param(family, level, half, id=f"{family}-{level}-{half}")
    for family in BEYOND_FLOAT16
    for level, half in (("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16"))
    # TensorFlow, the main backend, compiles `fit` in O2 float16 (10-40 s a
    # cell on a CPU); PyTorch runs every cell (1-2 s a cell). The rules and
    # the layers' arithmetic are the same on JAX, whose compiled float16
    # step the level matrix trains (CI's time).
    if TORCH
    or (BACKEND == "tensorflow" and (level, half) == ("O2", "float16"))
    # JAX: each family's compiled O2 float16 step, as on TensorFlow.
    or (JAX and (level, half) == ("O2", "float16"))
]
_KERAS_MIXED_FLOAT16_IS_NAN = {}


@pytest.mark.parametrize("family, level, half", _BEYOND_FLOAT16_CELLS)
def test_keras_hub_families_train_where_keras_mixed_policy_gives_nan(family, level, half):
    """T5Gemma's and T5Gemma2's encoder and decoder layers build their
    attention masks as `(1 - mask) * -1e9` in their compute dtype, which
    their attention adds to the logits: in float16, `0 * -inf` is NaN, and a
    padded query past the sliding window has only `-inf` logits, whose
    softmax is NaN. RWKV-7's time mix normalizes its keys with an epsilon of
    1e-12, 0 in float16: a padded token's zeroed keys give `0 * inf`. Under
    Keras's own `mixed_float16` their outputs are NaN. At O1/O2 in float16
    those layers run their own arithmetic in float32 (their projections,
    MLPs and norms as the level says): the outputs are float32's within the
    level's tolerance, and the model trains. (O3 in float16 is half
    everywhere, NaN as under Keras's own float16 policy.)"""
    model, x, y, loss = _build(family)
    reference = _np(model(x))
    if family not in _KERAS_MIXED_FLOAT16_IS_NAN:
        outputs = _keras_mixed_float16_outputs(family, x)
        _KERAS_MIXED_FLOAT16_IS_NAN[family] = not np.isfinite(outputs).all()
    # On a CPU; a GPU's kernels may keep Keras's outputs finite (PyTorch's
    # on an H100 did): keras_mp must train either way.
    assert _KERAS_MIXED_FLOAT16_IS_NAN[family] or backends.current.gpu_compute_capability()

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=loss,
        amp_level=level,
        amp_dtype=half,
        run_eagerly=not JAX and (level, half) != ("O2", "float16"),
    )
    if half == "float16":
        rows = keras_mp.precision_summary(model).rows
        in_float32 = {r["class"] for r in rows if "own arithmetic in float32" in r["rule"]}
        # O1: the layers are float32 anyway (not on the allow-list).
        assert level == "O1" or BEYOND_FLOAT16[family] <= in_float32
    out = _outputs(model, x)[0]
    bound = TOLERANCE[(level, half)] * (1.0 + np.max(np.abs(reference)))
    assert np.max(np.abs(_np(out) - reference)) <= bound
    before = [_np(v) for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # In float16 the dynamic scale may back off from 2**15 on the first steps
    # (T5Gemma2's do: three of its six steps with its head in float16); then
    # steps are applied.
    steps = 3 * -(-len(keras.tree.flatten(x)[0]) // 4)
    assert history.history.get("skipped_steps", [0])[-1] < steps
    after = [_np(v) for v in model.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def test_keras_hub_qwen3_5_trains_in_float16_where_keras_mixed_policy_does_not():
    """Qwen3.5's gated delta net L2-normalizes its queries and keys in its own
    code, `x * rsqrt(sum(x**2) + 1e-6)`: for a short key the gradient of
    rsqrt is inf in float16 whatever the loss scale. With this tiny model's
    PyTorch weights, every step of Keras's own `mixed_float16` overflows
    (its scale falls from 2**15 to 2**5) and the model does not train. At O2
    the layer's own arithmetic is float32 (its projections half): no step
    is skipped, and it trains."""
    model, x, y, loss = _build("qwen3_5")
    if BACKEND == "torch":
        keras_model = _built_under_keras_mixed_float16("qwen3_5")
        keras_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        before = [_np(v) for v in keras_model.trainable_variables]
        keras_model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        assert all(
            np.array_equal(_np(v), b) for v, b in zip(keras_model.trainable_variables, before)
        )

    # Its chunked recurrence costs 50 s to trace and compile on a CPU: the
    # step runs eagerly on TensorFlow; JAX (whose eager steps compile op by
    # op) checks the rule only.
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=loss, amp_level="O2", run_eagerly=True
    )
    assert "rsqrt's gradient overflows float16" in _rule(model, "Qwen3_5GatedDeltaNet")
    if JAX:
        return
    before = [_np(v) for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert history.history["skipped_steps"][-1] == 0
    assert np.isfinite(history.history["loss"]).all()
    after = [_np(v) for v in model.trainable_variables]
    assert all(not np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_keras_hub_llama_attention_in_float16(level):
    """KerasHub's own attention layers (here `LlamaAttention`) call
    `ops.dot_product_attention`: on JAX's CPU, which has no float16 x
    float16 -> float32 matmul, they compute in float32 (Keras's own
    `mixed_float16` fails there); elsewhere in float16."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=families.VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    ids, padding = families._tokens(np.random.default_rng(0))
    x = {"token_ids": ids, "padding_mask": padding}
    keras_mp.apply_amp(backbone, level, "float16")
    jax_cpu = JAX and __import__("jax").default_backend() == "cpu"
    rows = {r["class"]: r for r in keras_mp.precision_summary(backbone).rows}
    assert rows["LlamaAttention"]["compute_dtype"] == ("float32" if jax_cpu else "float16")
    assert rows["EinsumDense"]["compute_dtype"] == "float16"  # its projections
    assert np.isfinite(_np(backbone.predict(x, batch_size=len(ids), verbose=0))).all()


@pytest.mark.parametrize("level, half", [("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")])
def test_keras_hub_mixtral_routes_in_float32(level, half):
    """The router's projection and the routing (softmax, top-k, weights,
    load-balancing loss) in float32; the experts and attention as the level
    says. On TensorFlow, Keras's own mixed policies cannot train it: the
    load-balancing loss multiplies half weights by a float32 mask."""
    model, x, y, loss = _build("mixtral")
    keras_mp.apply_amp(model, level, half)
    rows = {r["class"]: r for r in keras_mp.precision_summary(model).rows}
    assert rows["MixtralSparseMoeBlock"]["compute_dtype"] == "float32"
    router = next(r for r in rows.values() if r["rule"].endswith("expert router, float32"))
    assert router["layer"].endswith("sparse_feedforward_gate_dense")
    experts = half if level != "O1" else "float32"  # O1: only the allow-list
    assert rows["MixtralMoeExperts"]["compute_dtype"] == experts
    # With a router allowed into half, the user's word wins.
    keras_mp.apply_amp(model, level, half, allow=["sparse_feedforward_gate_dense"])
    assert "router" not in _rule(model, "Dense")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="SavedModel export is TensorFlow's")
@pytest.mark.parametrize("family", ["bert", "resnet", "lstm_masked"])
def test_family_exports_a_float32_signature(family, tmp_path):
    import tensorflow as tf

    model, x, y, loss = _build(family)
    _compile(model, loss, "O2", "float16")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    expected = _np(model(x, training=False))
    path = str(tmp_path / family)
    model.export(path)
    signature = tf.saved_model.load(path).signatures["serving_default"]
    inputs = signature.structured_input_signature[1]
    assert {spec.dtype for spec in inputs.values() if spec.dtype.is_floating} <= {tf.float32}
    feed = x if isinstance(x, dict) else {next(iter(inputs)): x}
    feed = {name: tf.constant(feed[name], dtype=spec.dtype) for name, spec in inputs.items()}
    (served,) = signature(**feed).values()
    assert served.dtype == tf.float32
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-3, atol=1e-3)


# Compiled on TensorFlow and JAX in O2 float16 (15-25 s a cell on a CPU);
# PyTorch runs the other cells too (a few seconds each).
ON_TORCH_ONLY = pytest.mark.skipif(not TORCH, reason="CI time: compiled in O2 float16 here")
# How far a level's updates may be from float32's, over their size, after
# six steps of a transformer (measured on the three backends: at most 0.002
# in float16, 0.049 in bfloat16; the schedule's own effect is 0.25).
UPDATE_TOLERANCE = {"float16": 0.02, "bfloat16": 0.08}
_FEATURE_RUNS = {}


def _schedule():
    return keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=6, alpha=0.01)


def _features_run(optimizer, level=None, half=None):
    """The BERT's updates, its EMA and its optimizer after three epochs (six
    steps, in order) with `optimizer`: float32 (`level` None, op by op; once
    per process and optimizer) or at `level` in `half`, compiled."""
    key = (optimizer, level, half)
    if level is None and key in _FEATURE_RUNS:
        return _FEATURE_RUNS[key]
    model, x, y, loss = _build("bert")
    # No dropout: on TensorFlow a mask drawn in float16 is another mask
    # (its uniform draws are made in the input's dtype), and the updates are
    # compared step by step.
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    schedule = _schedule()
    inner = {
        # AdamW: decoupled weight decay, an EMA of the weights, a schedule.
        "adamw": lambda: keras.optimizers.AdamW(
            schedule, weight_decay=0.5, use_ema=True, ema_momentum=0.9
        ),
        "adamw-constant": lambda: keras.optimizers.AdamW(
            1e-2, weight_decay=0.5, use_ema=True, ema_momentum=0.9
        ),
        "adamw-no-ema": lambda: keras.optimizers.AdamW(schedule, weight_decay=0.5),
        # SGD: global clipping (Adam's updates hardly see a gradient's norm).
        "sgd": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
        "sgd-unclipped": lambda: keras.optimizers.SGD(0.5),
    }[optimizer]()
    amp = {} if level is None else {"amp_level": level, "amp_dtype": half}
    model.compile(optimizer=inner, loss=loss, run_eagerly=level is None and not JAX, **amp)
    before = [_np(v) for v in model.trainable_variables]
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    updates = [_np(v) - b for v, b in zip(model.trainable_variables, before)]
    averages = [_np(v) for v in getattr(inner, "_model_variables_moving_average", [])]
    run = {"updates": updates, "before": before, "averages": averages, "model": model, "x": x}
    run["optimizer"] = inner
    if level is None:
        _FEATURE_RUNS[key] = run
    return run


def _distance(run, reference):
    """The distance of `run`'s updates from `reference`'s, over their size."""
    got = np.concatenate([u.ravel() for u in run["updates"]])
    want = np.concatenate([u.ravel() for u in reference["updates"]])
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize(
    "level, half",
    [
        pytest.param("O1", "bfloat16", marks=ON_TORCH_ONLY),
        ("O2", "float16"),
        pytest.param("O2", "bfloat16", marks=ON_TORCH_ONLY),
    ],
)
def test_optimizer_features_on_a_transformer(level, half):
    """AdamW's weight decay, its EMA and a learning-rate schedule, and SGD's
    global clipping, under a level: the updates follow the same optimizer's
    in float32 step by step, within the half dtype's tolerance, and each
    feature's own effect is larger than that tolerance, so that a feature
    lost (or clipping of the scaled gradients) fails.

    Not O3 (CI time): O3's clipping, EMA and weight decay over float32 master
    weights are tested in test_inner_optimizer.py.
    """
    tolerance = UPDATE_TOLERANCE[half]
    reference = _features_run("adamw")
    run = _features_run("adamw", level, half)
    assert _distance(run, reference) < tolerance
    # The schedule: its decay changes the updates more than the level may.
    assert _distance(_features_run("adamw-constant"), reference) > 2 * tolerance
    inner = run["optimizer"]
    assert inner is getattr(run["model"].optimizer, "inner_optimizer", run["model"].optimizer)
    assert int(_np(inner.iterations)) == 6
    # Weight decay: the token embeddings of ids the batch never holds get no
    # gradient (Adam's update is 0): the decay alone moves them, at the
    # level by float32's factor (about 0.99 over the six steps).
    model = run["model"]
    embedding = model.backbone.token_embedding.embeddings
    index = next(i for i, v in enumerate(model.trainable_variables) if v is embedding)
    rows = np.setdiff1d(np.arange(embedding.shape[0]), run["x"]["token_ids"])
    assert len(rows) > 10

    def decay(got):
        return 1.0 + got["updates"][index][rows] / got["before"][index][rows]

    assert np.max(decay(reference)) < 0.995
    np.testing.assert_allclose(decay(run), decay(reference), rtol=1e-4)
    # The EMA: `fit` ends by writing the averages into the weights, which
    # followed float32's above; without it they are far from them.
    assert len(run["averages"]) == len(model.trainable_variables)
    for average, variable in zip(run["averages"], model.trainable_variables):
        np.testing.assert_array_equal(average, _np(variable))
    assert _distance(_features_run("adamw-no-ema"), reference) > 2 * tolerance
    # Global clipping, of the unscaled gradients: SGD's updates follow
    # float32's; unclipped they are far from them.
    clipped = _features_run("sgd")
    assert _distance(_features_run("sgd", level, half), clipped) < tolerance
    assert _distance(_features_run("sgd-unclipped"), clipped) > 2 * tolerance
