"""The precision doctor, `keras_mp.analyze`, against direct computations.

Each backend takes the gradients and records the activations its own way:
the known gradient and the overflowing layer run on each. The report's
arithmetic, its table and its advice are proven once (`one_backend`)."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.tools import half_range
from tests.tools.test_half_range import KNOWN
from tests.tools.test_half_range import direct_underflow

# Gradient values chosen across float16's range: some flush to zero at a
# scale of 1, fewer at 2**10, one passes float16's maximum at 2**10.


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _mean_output(y_true, y_pred):
    return keras.ops.mean(y_pred, axis=-1)


def _known_gradient_model(scale):
    """loss = mean(x @ W) with one sample: dL/dW = x exactly."""
    model = keras.Sequential(
        [keras.Input((KNOWN.size,)), keras.layers.Dense(1, use_bias=False, name="probe")]
    )
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=scale),
        loss=_mean_output,
        amp_level="O2",
    )
    return model


def test_underflow_share_matches_a_direct_computation():
    model = _known_gradient_model(2.0**10)
    report = keras_mp.analyze(model, KNOWN[None, :], np.zeros((1, 1), "float32"), print_fn=None)
    (kernel,) = [g for path, g in report.gradients.items() if path.endswith("probe/kernel")]
    np.testing.assert_array_equal(kernel.ravel(), KNOWN)
    (row,) = [r for r in report.rows if r["layer"].endswith("probe")]
    assert report.current_loss_scale == 2.0**10
    # max |g| = 100: 65504 / (2 * 100) = 327.5 -> 2**8.
    assert report.recommended_loss_scale == 2.0**8
    assert row["underflow_current"] == pytest.approx(direct_underflow(KNOWN, 2.0**10))
    assert row["underflow_recommended"] == pytest.approx(direct_underflow(KNOWN, 2.0**8))
    assert row["underflow_current"] == 1 / 8  # 1e-12 < 2**-35 (~2.9e-11)
    assert row["underflow_recommended"] == 2 / 8  # and 1e-10 < 2**-33
    assert row["overflow_current"] == 1 / 8  # 100 * 1024 > 65504
    assert row["overflow_recommended"] == 0.0
    assert row["max_gradient"] == pytest.approx(100.0)
    # The loss scale passed explicitly wins over the optimizer's.
    at_one = keras_mp.analyze(
        model, KNOWN[None, :], np.zeros((1, 1)), loss_scale=1.0, print_fn=None
    )
    (row,) = [r for r in at_one.rows if r["layer"].endswith("probe")]
    assert row["underflow_current"] == pytest.approx(direct_underflow(KNOWN, 1.0)) == 4 / 8


def _cnn(kernel_scale=1.0):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(8, name="wide")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="probs")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", amp_level="O2")
    wide = model.get_layer("wide")
    wide.kernel.assign(_numpy(wide.kernel) * kernel_scale)
    return model


def _batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8, 8, 1)).astype("float32"), rng.integers(0, 3, size=16)


def test_flags_a_layer_that_overflows_float16_and_leaves_the_model_alone():
    model = _cnn(kernel_scale=1e5)
    x, y = _batch()
    before = [w.copy() for w in model.get_weights()]
    report = keras_mp.analyze(model, x, y, print_fn=None)
    rows = {r["layer"].split("/")[-1]: r for r in report.rows}
    assert set(rows) == {"conv", "bn", "relu", "flatten", "wide", "probs"}
    wide = rows["wide"]
    assert wide["keep_float32"] and wide["max_activation"] > 65504
    assert wide["finite_in_policy"] is False  # float16 overflowed in the model's pass
    assert "of float16's maximum" in wide["reason"]
    assert report.keep_float32 == [r["layer"] for r in report.rows if r["keep_float32"]]
    assert not rows["conv"]["keep_float32"] and rows["conv"]["finite_in_policy"]
    assert "Keep in float32: " in report.text and wide["layer"] in report.text
    # Nothing changed: weights, BatchNorm statistics.
    for b, a in zip(before, model.get_weights()):
        np.testing.assert_array_equal(b, a)


@pytest.mark.one_backend
def test_healthy_model_and_bfloat16():
    model = _cnn()
    x, y = _batch()
    report = keras_mp.analyze(model, x, y, print_fn=None)
    assert report.keep_float32 == []
    assert report.current_loss_scale == 2.0**15
    assert 1.0 <= report.recommended_loss_scale <= 2.0**24
    bf16 = keras_mp.analyze(model, x, y, dtype="bfloat16", print_fn=None)
    assert bf16.recommended_loss_scale == 1.0 and "no loss scaling needed" in bf16.text
    assert all(r["underflow_current"] in (None, 0.0) for r in bf16.rows)


@pytest.mark.one_backend
def test_prints_a_table(capsys):
    model = _cnn()
    x, y = _batch()
    report = keras_mp.analyze(model, x, y)
    out = capsys.readouterr().out
    assert out.strip() == str(report).strip()
    assert any(line.split()[:3] == ["Layer", "(class)", "Compute"] for line in out.splitlines())
    assert "Recommended initial loss scale:" in out


@pytest.mark.one_backend
def test_the_table_fits_100_columns_with_long_names_and_notes():
    keras.utils.set_random_seed(0)
    long_name = "a_dense_layer_with_a_name_as_long_as_a_keras_hub_path_" + "x" * 60 + "_end"
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, name=long_name)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer="adam", loss="mse", amp_level="O2")
    layer = model.get_layer(long_name)
    layer.kernel.assign(_numpy(layer.kernel) * 1e5)  # overflows float16: flagged, with a note
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    report = keras_mp.analyze(model, x, np.zeros((4, 1), "float32"), print_fn=None)
    lines = report.text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert any(line.startswith("    keep float32: activations reach") for line in lines)
    assert any(line.startswith("...") and "x_end (Dense)" in line for line in lines)


@pytest.mark.one_backend
def test_keeps_the_current_scale_when_a_change_would_not_help():
    """Nothing underflows at 2**10 here: the largest safe scale (2**14)
    would gain nothing, so the doctor says to keep 2**10."""
    values = np.array([1e-3, 0.01, 0.5, 1.0], "float32")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1, use_bias=False, name="probe")]
    )
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**10),
        loss=_mean_output,
        amp_level="O2",
    )
    report = keras_mp.analyze(model, values[None, :], np.zeros((1, 1), "float32"), print_fn=None)
    assert half_range.recommended_loss_scale(list(report.gradients.values())) == 2.0**14
    assert report.recommended_loss_scale == 2.0**10
    assert "keep the current 1024: no gradient value underflows or overflows" in report.advice
    # Where the larger scale saves values, it is recommended, and says how many.
    small = keras_mp.analyze(
        model, values[None, :] * 1e-9, np.zeros((1, 1), "float32"), print_fn=None
    )
    assert small.recommended_loss_scale > 2.0**10
    assert "flushes" in small.advice and "the current 1024" in small.advice


@pytest.mark.one_backend
def test_attention_and_subclassed_models():
    class Block(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(2, 4)
            self.norm = keras.layers.LayerNormalization()
            self.head = keras.layers.Dense(2)

        def call(self, x):
            return self.head(self.norm(x + self.attention(x, x))[:, 0])

    model = Block()
    model.compile(optimizer="adam", loss="mse", amp_level="O2")
    x = np.random.default_rng(0).normal(size=(4, 5, 8)).astype("float32")
    report = keras_mp.analyze(model, x, np.zeros((4, 2), "float32"), print_fn=None)
    names = [r["layer"] for r in report.rows]
    assert any("query" in n for n in names) and any("norm" in n for n in names)
    # In the order they run, each layer's sublayers under it.
    order = ["multi_head_attention", "query", "key", "value", "attention_output", "norm", "dense"]
    positions = [next(i for i, n in enumerate(names) if part in n) for part in order]
    assert positions == sorted(positions), names
    grads = sum(r["gradient_values"] for r in report.rows)
    assert grads == sum(int(np.prod(v.shape)) for v in model.trainable_variables)


@pytest.mark.one_backend
def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model = _known_gradient_model(2.0**10)
    report = keras_mp.analyze(model, KNOWN[None, :], np.zeros((1, 1)), print_fn=None)
    figure = report.plot(str(tmp_path / "grads.png"))
    assert (tmp_path / "grads.png").stat().st_size > 1000
    assert len(figure.axes[0].lines) == 4  # underflow/overflow x current/recommended


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"y": None}, ValueError, "Received: y=None"),
        ({"dtype": "float64"}, ValueError, "dtype='float64'"),
        ({"loss_scale": -1}, ValueError, "loss_scale=-1"),
        ({"loss_scale": "dynamic"}, ValueError, "loss_scale='dynamic'"),
    ],
)
def test_bad_arguments(kwargs, error, fragment):
    model = _cnn()
    x, y = _batch()
    arguments = dict(y=y, print_fn=None)
    arguments.update(kwargs)
    with pytest.raises(error, match=fragment):
        keras_mp.analyze(model, x, **arguments)


@pytest.mark.one_backend
def test_needs_a_loss():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Received: loss=None"):
        keras_mp.analyze(model, np.zeros((2, 3)), np.zeros((2, 1)), print_fn=None)
    with pytest.raises(TypeError, match="Received: model="):
        keras_mp.analyze("model", np.zeros((2, 3)), np.zeros((2, 1)))


@pytest.mark.one_backend
@pytest.mark.parametrize("family", ["gemma", "gpt2"])
def test_a_language_model_s_head_in_float16_keeps_its_headroom(family):
    """The output rule puts a causal LM's tied head (its logits matmul) in
    float16 at O2. Trained there with its float32 loss, the doctor finds its
    outputs (embeddings and logits) far inside float16's range, finite in
    the model's own pass, and nothing to keep in float32."""
    from tests.zoo import families

    keras.utils.set_random_seed(0)
    model, x, y, loss = getattr(families, family)()
    model.compile(optimizer="adam", loss=loss, amp_level="O2", amp_dtype="float16")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    rows = {r["layer"].split("/")[-1]: r for r in keras_mp.precision_summary(model).rows}
    assert rows["token_embedding"]["compute_dtype"] == "float16"
    assert "model output: returns float32" in rows["token_embedding"]["rule"]
    report = keras_mp.analyze(model, x, y, print_fn=None)
    (head,) = [r for r in report.rows if r["layer"].split("/")[-1] == "token_embedding"]
    assert head["finite_in_policy"] and not head["keep_float32"], head
    assert 0 < head["max_activation"] < 65504 / 100, head
