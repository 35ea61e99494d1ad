"""The precision rules, row by row: each row of `RULES` decides for the layer
it is written for, in the place it is written for, with its policy and reason;
a new row is one line; and some row decides for every layer at every level."""

import keras
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_mp._src import backends
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import rules
from keras_mp._src.precision.layer_kinds import of_class

pytestmark = pytest.mark.one_backend

L = keras.layers


class Block(L.Layer):
    """A composite layer of the user's (its own arithmetic is unknown)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(2)

    def call(self, x):
        return self.dense(x) * 2.0


class SparseMoeBlock(L.Layer):
    num_experts = 4


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = L.Dense(2)

    def call(self, x):
        return self.dense(x)


def _decide(
    layer,
    level,
    half="float16",
    parent=None,
    output=False,
    inside=False,
    denied=False,
    head=None,
    loss=None,
    **amp,
):
    settings_ = amp_settings.for_layers(level, half, **amp)
    model = keras.Sequential([L.Dense(1)])
    place = rules.Place(
        settings_,
        model,
        parent,
        output=output,
        inside_allowed=inside,
        inside_denied=denied,
        head=head,
        loss=loss,
    )
    return rules.decide(layer, place)


def _quantized():
    dense = L.Dense(4)
    dense.build((None, 4))
    dense.quantize("int8")
    return dense


# (the row's reason, the layer, where it is, the level, what it gets)
ROWS = [
    ("quantized (int8_from_float32): kept", _quantized, {}, "O2", None),
    ("int64 outputs: kept", lambda: L.Hashing(8), {}, "O2", None),
    ("O2: model, float32 inputs and outputs", Net, {"output": True}, "O2", "float32"),
    (
        "O3: deny=, float32",
        lambda: keras.Sequential([L.Dense(2)], name="ema_network"),
        {"deny": ["ema_network"]},
        "O3",
        "float32",
    ),
    ("O2: container", lambda: keras.Sequential([L.Dense(2)]), {}, "O2", "mixed_float16"),
    ("O3: container", lambda: keras.Sequential([L.Dense(2)]), {}, "O3", "float16"),
    ("probabilities in float32", L.Softmax, {}, "O3", "float32"),
    (
        "model output (loss mean_squared_error): float16 could overflow it, float32 "
        "(bfloat16 or allow= for half)",
        lambda: L.Dense(1),
        {"output": True, "head": False, "loss": ("mean_squared_error", False)},
        "O2",
        "float32",
    ),
    (
        "model output: your layer, float32 (allow= for half)",
        Block,
        {"output": True},
        "O2",
        "float32",
    ),
    (
        "indices, counts and bins: float32 at every level",
        lambda: L.CategoryEncoding(4),
        {},
        "O3",
        "float32",
    ),
    ("input statistics: float32 at every level", L.Normalization, {}, "O2", "float32"),
    ("O0: float32", lambda: L.Dense(2), {}, "O0", "float32"),
    ("O1: deny=, float32", lambda: L.Dense(2), {"deny": [L.Dense]}, "O1", "float32"),
    ("O2: expert router, float32", lambda: L.Dense(4), {"parent": "moe"}, "O2", "float32"),
    (
        "O3: expert routing in float32 (experts in half)",
        SparseMoeBlock,
        {},
        "O3",
        "float32",
    ),
    (
        "O2: own arithmetic in float32 (your layer; allow= for half)",
        Block,
        {},
        "O2",
        "float32",
    ),
    ("O1 allow-list", lambda: L.Conv2D(2, 3), {}, "O1", "mixed_float16"),
    ("O1: inside an allow-listed layer", L.ReLU, {"inside": True}, "O1", "mixed_float16"),
    ("O1 deny-list", L.LayerNormalization, {"inside": True}, "O1", "float32"),
    ("O1: not on the allow-list", L.ReLU, {}, "O1", "float32"),
    ("O2 deny-list", L.BatchNormalization, {}, "O2", "float32"),
    ("O2: half compute, float32 variables", L.ReLU, {}, "O2", "mixed_float16"),
    (
        "O3: keep_batchnorm_fp32=True",
        L.BatchNormalization,
        {"keep_batchnorm_fp32": True},
        "O3",
        "float32",
    ),
    ("O3: half everywhere", L.BatchNormalization, {}, "O3", "float16"),
]


@pytest.mark.parametrize("reason, make, where, level, policy", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_decides_for_its_layer(reason, make, where, level, policy):
    where = dict(where)
    parent = SparseMoeBlock() if where.pop("parent", None) == "moe" else None
    got = _decide(make(), level, parent=parent, **where)
    assert got == (policy, reason)


def test_every_row_of_the_table_is_tested_here_or_in_the_zoo():
    decided = set()
    for _, make, where, level, _ in ROWS:
        where = dict(where)
        parent = SparseMoeBlock() if where.pop("parent", None) == "moe" else None
        output, inside = where.pop("output", False), where.pop("inside", False)
        head, loss = where.pop("head", None), where.pop("loss", None)
        amp = amp_settings.for_layers(level, "float16", **where)
        place = rules.Place(
            amp, None, parent, output=output, inside_allowed=inside, head=head, loss=loss
        )
        decided.add(id(rules.first_rule(make(), place)))
    # KerasHub's families (T5, T5Gemma, RWKV-7, Qwen3.5): tests/zoo builds
    # those models and checks their rows; JAX's CPU attention: test_policies.
    in_the_zoo = ("masks with -1e9", "eps 1e-12", "rsqrt", "attention on JAX")
    # The FP8 rows (`amp_dtype="float8"`): test_float8.py decides each.
    in_the_zoo += ("float8",)
    for rule in rules.RULES:
        assert id(rule) in decided or any(z in rule.reason for z in in_the_zoo), rule.reason


def test_everything_inside_a_nested_model_named_in_deny_is_float32():
    """`deny=[model.ema_network]`: the network and every layer in it."""
    assert _decide(L.Dense(2), "O3", denied=True) == ("float32", "O3: deny=, float32")
    assert _decide(L.BatchNormalization(), "O2", denied=True)[0] == "float32"


def test_allow_overrides_the_float32_rows_it_names():
    assert _decide(Block(), "O2", allow=[Block]) == (
        "mixed_float16",
        "O2: half compute, float32 variables",
    )
    assert _decide(L.Dense(4), "O2", parent=SparseMoeBlock(), allow=[L.Dense])[0] == (
        "mixed_float16"
    )


def test_a_new_rule_is_one_row():
    """What docs/design.md shows a newcomer: a row above the level's rows."""

    class Gate(L.Layer):
        pass

    row = rules.Rule(
        (rules.layer_is(of_class(Gate)), rules.computes(rules.Compute.DENY, rules.Compute.ALL)),
        rules.FLOAT32,
        "{level}: gates in float32",
    )
    table = rules.RULES[:-9] + (row,) + rules.RULES[-9:]
    place = rules.Place(amp_settings.for_layers("O2"), keras.Sequential([L.Dense(1)]))
    assert rules.decide(Gate(), place, table) == ("float32", "O2: gates in float32")
    assert rules.decide(Gate(), place) == ("mixed_float16", "O2: half compute, float32 variables")
    assert rules.decide(L.ReLU(), place, table) == rules.decide(L.ReLU(), place)


LAYERS = [
    lambda: L.Dense(2),
    L.ReLU,
    L.BatchNormalization,
    L.LayerNormalization,
    lambda: L.MultiHeadAttention(2, 4),
    Block,
    lambda: L.Hashing(8),
    lambda: keras.Sequential([L.Dense(2)]),
    L.Softmax,
]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(LAYERS),
    st.sampled_from(["O0", "O1", "O2", "O3"]),
    st.sampled_from(["float16", "bfloat16"]),
    st.booleans(),
    st.booleans(),
)
def test_some_row_decides_every_layer_at_every_level(make, level, half, output, inside):
    layer = make()
    policy, reason = _decide(layer, level, half, output=output, inside=inside)
    assert reason and "{" not in reason
    if policy is not None:
        policy = keras.dtype_policies.get(policy)
        assert policy.compute_dtype in ("float32", half)
        if level == "O0":
            assert policy.compute_dtype == "float32" or isinstance(layer, keras.Model)
        if isinstance(layer, L.Softmax) or (output and isinstance(layer, Block)):
            # Probabilities (anywhere), and your own layer's code at an
            # output, are float32.
            assert policy.compute_dtype == "float32"
    attention_float32 = backends.current.half_attention_needs_float32(half)
    # Any other layer computes in half at O3, the model's output layers too.
    if level == "O3" and not isinstance(layer, (L.Hashing, Block, L.Softmax)):
        assert policy is not None and (policy.compute_dtype == half or attention_float32), reason
