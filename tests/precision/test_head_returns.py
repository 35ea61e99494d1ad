"""A float32 head's outputs reach the model's outputs in float32 from a
`call` computing in half (`head_returns.py`): a subclassed model at O3 in
float16, whose price head (128000 from inputs of 2000, inf in float16)
returned its outputs in float16 to the model's `call` before, so that the
model predicted inf and `fit` skipped every step.

Each backend runs the step its own way (TensorFlow refuses arithmetic
across dtypes): the fits run on all three.
"""

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
ONES = keras.initializers.Constant(1.0)
SMALL = keras.initializers.Constant(1e-4)
X = np.full((4, 8), 2000.0, "float32")  # 8 * 2000 * 8 = 128000 at the price head
Y = (np.full((4, 1), 1.5e5, "float32"), np.zeros((4,), "int32"))
LOSS = ["mae", "sparse_categorical_crossentropy"]


class Head(L.Layer):
    """A head layer of the user's own, holding the Dense(1)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(1, kernel_initializer=ONES, name="inner")

    def call(self, x):
        return self.dense(x)


class Prices(keras.Model):
    """Its price head's outputs go to its outputs as `returns` says."""

    def __init__(self, returns, head=None):
        super().__init__()
        self.returns = returns
        self.body = L.Dense(8, kernel_initializer=ONES, name="body")
        self.price = head or L.Dense(1, kernel_initializer=ONES, name="price")
        self.cls = L.Dense(3, kernel_initializer=SMALL, name="cls")

    def call(self, x):
        h = self.body(x)
        return self.returns(self.price(h), h), self.cls(h)


def _fit(model, built=True):
    if built:
        model(X[:1])
    model.compile(optimizer="adam", loss=LOSS, amp_level="O3", amp_dtype="float16")
    history = model.fit(X, Y, epochs=3, batch_size=4, verbose=0).history
    price, _ = model.predict(X, verbose=0)
    rows = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    return price, history["skipped_steps"][-1], rows


def _as_it_is(p, h):
    return p


def _added(p, h):
    return p + h[:, :1]


@pytest.mark.parametrize("returns", [_as_it_is, _added], ids=["as_it_is", "added"])
def test_a_float32_heads_outputs_reach_the_models_outputs_in_float32(returns):
    """As it is: the head returns float32, the model's own arithmetic and
    its other layers stay in half. Added to a half tensor (`price + h`:
    TensorFlow refuses float32 + float16; torch.autocast promotes it to
    float32, as this does): the model's own arithmetic is float32."""
    model = Prices(returns)
    # Added: compiled before it is built, decided again when `fit` builds it.
    price, skipped, rows = _fit(model, built=returns is _as_it_is)
    assert np.all(np.isfinite(price)) and skipped == 0
    if returns is _as_it_is:
        assert rows[f"{model.name}/price"].endswith(f"returns float32 to {model.name}")
        assert rows[model.name] == "O3: model, float32 inputs and outputs"
        assert model.body.compute_dtype == "float16"
    else:
        assert "; own arithmetic in float32 (" in rows[model.name]
        assert rows[f"{model.name}/cls"].endswith(f"returns float32 to {model.name}")


def _off_the_way(p, h):
    keras.ops.mean(p * h[:, :1])  # a call taking it that leads to no output
    return p


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "returns, head, alone",
    [
        (lambda p, h: keras.ops.expand_dims(keras.ops.squeeze(p, -1) * 2.0, -1), None, True),
        (_as_it_is, "yours", True),
        (lambda p, h: keras.ops.concatenate([p, h[:, :1]], axis=-1)[:, :1], None, False),
        (_off_the_way, None, False),
    ],
    ids=["through_ops", "your_head_layer", "concatenated", "off_the_way"],
)
def test_where_its_outputs_go_decides_what_it_returns(returns, head, alone):
    model = Prices(returns, Head(name="head") if head else None)
    model(X[:1])
    model.compile(optimizer="adam", loss=LOSS, amp_level="O3", amp_dtype="float16")
    assert np.all(np.isfinite(model.predict(X, verbose=0)[0]))
    rows = {r["layer"]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    returned = rows[f"{model.name}/{'head' if head else 'price'}"]
    assert returned.endswith(f"returns float32 to {model.name}") == alone
    assert ("own arithmetic in float32" in rows[model.name]) != alone
