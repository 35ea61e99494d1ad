"""The head rule (issue 63.1): an output that float16 could overflow
computes in float32; a cross-entropy's logits, and bfloat16, stay in half.

The regression is issue 63's: two Dense layers on house prices (targets
5e4 to 3e5), Adam(0.3). With the price layer in float16 its outputs
overflowed to inf and MAE's finite gradient applied the steps; now every
half level trains as O0 does.
"""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.precision import output_losses

pytestmark = pytest.mark.one_backend

L = keras.layers


def _prices():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (1.75e5 + 6e4 * np.tanh(x[:, :1] + 0.5 * x[:, 1:2])).astype("float32")
    return x, y


def _regression(level, dtype="float16", loss="mae"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), L.Dense(32, activation="relu"), L.Dense(1, name="price")]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.3), loss=loss, amp_level=level, amp_dtype=dtype)
    return model


@pytest.fixture(scope="module")
def o0_history():
    x, y = _prices()
    return _regression("O0").fit(x, y, epochs=30, batch_size=32, verbose=0).history["loss"]


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_regression_head_on_prices_trains_as_float32_does(level, o0_history):
    x, y = _prices()
    model = _regression(level)
    price = model.get_layer("price")
    assert price.compute_dtype == "float32"
    row = [r for r in keras_mp.precision_summary(model).rows if r["layer"].endswith("price")][0]
    assert row["rule"].startswith("model output (loss mean_absolute_error): float16 could")
    history = model.fit(x, y, epochs=30, batch_size=32, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)) and np.all(np.isfinite(model.predict(x, verbose=0)))
    # It trains as O0 does: the hidden layer's float16 rounding moves the
    # path (Adam at 0.3), not where it ends.
    assert history[-1] < 0.25 * history[0]
    np.testing.assert_allclose(history[-1], o0_history[-1], rtol=0.1)


def test_bfloat16_and_cross_entropy_keep_the_head_in_half():
    assert _regression("O2", "bfloat16").get_layer("price").compute_dtype == "bfloat16"
    model = keras.Sequential([keras.Input((8,)), L.Dense(16), L.Dense(10, name="logits")])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        amp_level="O2",
    )
    assert model.get_layer("logits").compute_dtype == "float16"


def test_each_output_is_decided_by_its_own_loss():
    """A dict of losses by output name, a list in output order: the
    classifier's logits in half, the regression's float32; an unknown loss
    (a function of the user's) float32, said by name."""

    def model():
        inputs = keras.Input((4,))
        x = L.Dense(8)(inputs)
        return keras.Model(inputs, [L.Dense(3, name="cls")(x), L.Dense(1, name="reg")(x)])

    for loss in (
        {"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        ["categorical_crossentropy", "huber"],
    ):
        m = model()
        m.compile(optimizer="sgd", loss=loss, amp_level="O2")
        assert m.get_layer("cls").compute_dtype == "float16", loss
        assert m.get_layer("reg").compute_dtype == "float32", loss

    def my_loss(y_true, y_pred):
        return keras.ops.mean(y_pred)

    m = model()
    m.compile(optimizer="sgd", loss=my_loss, amp_level="O2")
    assert m.get_layer("cls").compute_dtype == "float32"
    rows = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(m).rows}
    assert rows["cls"].startswith("model output (loss my_loss): float16 could overflow it")


def test_a_head_behind_weightless_layers_is_the_head():
    """`Dense(1) -> Reshape` (a regression reshaped), `Dense -> Activation
    ("sigmoid")` (bounded): the Dense is the head; bounded, it stays half."""
    inputs = keras.Input((4,))
    reg = L.Reshape((1, 1), name="reshape")(L.Dense(1, name="reg")(inputs))
    prob = L.Activation("sigmoid", name="sig")(L.Dense(1, name="logit")(inputs))
    model = keras.Model(inputs, [reg, prob])
    model.compile(optimizer="sgd", loss=["mse", "mse"], amp_level="O2")
    assert model.get_layer("reg").compute_dtype == "float32"
    assert model.get_layer("logit").compute_dtype == "float16"
    assert model.get_layer("sig").compute_dtype == "float32"  # probabilities


def test_loss_names():
    assert output_losses.loss_name("mse") == "mean_squared_error"
    assert output_losses.loss_name(keras.losses.Huber()) == "huber"
    assert output_losses.loss_name(keras.losses.BinaryCrossentropy()) == "binary_crossentropy"
    assert output_losses.describe(None) == "no loss keras_mp knows"


def _compiled_heads(model, loss):
    model.compile(optimizer="adam", loss=loss, amp_level="O2")
    return {
        layer.name: layer.compute_dtype
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, L.Dense)
    }


def test_the_head_is_found_in_every_shape_users_write():
    """Review of issue 63: a subclassed model whose head is made before its
    body (the order of calls decides, not of attributes); a Sequential whose
    last layer is a nested Sequential; a regression output that another head
    also reads; dict outputs keyed by their own keys."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.head = L.Dense(1, name="sub_head")
            self.body = L.Dense(8, name="sub_body")

        def call(self, x):
            return self.head(self.body(x))

    net = Net()
    net(np.zeros((2, 4), "float32"))
    assert _compiled_heads(net, "mse") == {"sub_head": "float32", "sub_body": "float16"}

    nested = keras.Sequential(
        [
            keras.Input((4,)),
            L.Dense(8, name="seq_body"),
            keras.Sequential([L.Dense(8, name="seq_h"), L.Dense(1, name="seq_reg")]),
        ]
    )
    heads = _compiled_heads(nested, "mse")
    assert heads["seq_reg"] == "float32" and heads["seq_body"] == "float16"

    inputs = keras.Input((4,))
    price = L.Dense(1, name="price")(inputs)
    cls = L.Dense(3, name="cls")(L.Concatenate()([inputs, price]))
    shared = keras.Model(inputs, [price, cls])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert _compiled_heads(shared, ["mse", ce]) == {"price": "float32", "cls": "float16"}

    inputs = keras.Input((4,))
    body = L.Dense(8, name="dict_body")(inputs)
    outputs = {
        "logits": L.Dense(3, name="dict_cls")(body),
        "value": L.Dense(1, name="dict_reg")(body),
    }
    keyed = keras.Model(inputs, outputs)
    assert _compiled_heads(keyed, {"logits": ce, "value": "mse"}) == {
        "dict_body": "float16",
        "dict_cls": "float16",
        "dict_reg": "float32",
    }


@pytest.mark.parametrize("tail", ["squeeze", "rescale"])
def test_a_head_behind_a_keras_op_is_the_head(tail):
    """`ops.squeeze(price, -1)` for targets of shape (batch,), `price * 1e4`
    to undo the targets' scaling: an output made by a Keras operation is
    its layers', as far as its range goes. Before, the Dense stayed in
    float16 and predicted inf; a cross-entropy's logits behind the same
    operation stay in half."""
    ones = keras.initializers.Constant(1.0)

    def model(loss, dtype="float16"):
        inputs = keras.Input((8,))
        hidden = L.Dense(8, kernel_initializer=ones)(inputs)
        head = L.Dense(1, kernel_initializer=ones, name="head")(hidden)
        out = keras.ops.squeeze(head, -1) if tail == "squeeze" else head * 1e4
        built = keras.Model(inputs, out)
        expected = built.predict(x, verbose=0)
        built.compile(optimizer="adam", loss=loss, amp_level="O2", amp_dtype=dtype)
        return built, expected

    x = np.full((2, 8), 2000.0, "float32")  # 128000 at the head: inf in float16
    regression, expected = model("mae")
    got = regression.predict(x, verbose=0)
    assert got.dtype == "float32"
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    row = [r for r in keras_mp.precision_summary(regression).rows if r["layer"] == "head"][0]
    assert row["compute_dtype"] == "float32"
    assert row["rule"].startswith("model output (loss mean_absolute_error): float16 could")
    logits, _ = model(keras.losses.BinaryCrossentropy(from_logits=True))
    assert logits.get_layer("head").compute_dtype == "float16"
    in_bfloat16, _ = model("mae", "bfloat16")
    assert in_bfloat16.get_layer("head").compute_dtype == "bfloat16"
    assert in_bfloat16.predict(x, verbose=0).dtype == "float32"
