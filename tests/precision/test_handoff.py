"""Half between a float32 layer and its half consumers while its model runs
(`precision/handoff.py`, issue 65)."""

import keras
import numpy as np

import keras_mp


def _handoff_model():
    """A BatchNormalization whose one consumer computes in half, and a
    LayerNormalization whose outputs reach the model's output (through a
    `Reshape`) and a half Dense."""
    inputs = keras.Input((8,))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="d1")(inputs))
    ln = keras.layers.LayerNormalization(name="ln")(keras.layers.Dense(8, name="d2")(x))
    out = keras.layers.Dense(3, name="out")(ln)
    return keras.Model(inputs, [out, keras.layers.Reshape((2, 4), name="moved")(ln)])


def _returned_dtypes(model, x, names):
    """The dtype each named layer returns while `model` runs (a layer of
    the user's after it notes what it received, before any cast)."""
    seen = {}
    for name in names:
        layer = model.get_layer(name)
        call = layer.call

        def noting(*args, _name=name, _call=call, **kwargs):
            out = _call(*args, **kwargs)
            seen[_name] = keras.backend.standardize_dtype(out.dtype)
            return out

        object.__setattr__(layer, "call", noting)
    try:
        outputs = model(x)
    finally:
        for name in names:
            model.get_layer(name).__dict__.pop("call", None)
    return seen, outputs


def test_a_float32_layer_returns_half_only_while_its_model_runs_it():
    """Its consumers would round its outputs to half on their way in: while
    the model runs, it hands them half (half the bytes held between them),
    with its reason in the summary; the model's outputs are the same. Not
    where its outputs reach a model output, nor to a feature extractor built
    on its nodes, another model or a direct call, nor once its consumer is
    float32 (`to_float`). (bfloat16: in float16 the heads of outputs
    without a loss are float32, `test_output_losses.py`.)"""
    keras.utils.set_random_seed(0)
    model = _handoff_model()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32") * 3
    keras_mp.apply_amp(model, "O2", "bfloat16")
    extractor = keras.Model(model.inputs, model.get_layer("bn").output)
    inputs = keras.Input((8,))
    later = keras.Model(inputs, model.get_layer("bn")(inputs))
    bn = model.get_layer("bn")
    assert bn.compute_dtype == "float32"
    seen, outputs = _returned_dtypes(model, x, ["bn", "ln"])
    assert seen == {"bn": "bfloat16", "ln": "float32"}, seen
    assert [keras.backend.standardize_dtype(o.dtype) for o in outputs] == ["float32"] * 2
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(model).rows}
    assert rules["bn"].startswith("O2 deny-list; returns bfloat16 to its bfloat16 consumers")
    assert rules["ln"] == "O2 deny-list", rules
    for other in (extractor, later, bn):
        assert keras.backend.standardize_dtype(other(x).dtype) == "float32", other.name

    # The consumer in float32: the BatchNormalization's outputs reach it
    # unrounded, as before the hand-off.
    keras_mp.to_float(model.get_layer("d2"), "float32")
    seen, _ = _returned_dtypes(model, x, ["bn"])
    assert seen == {"bn": "float32"}, seen


class _Residual(keras.layers.Layer):
    """A layer of the user's own code holding a norm the model also calls."""

    def __init__(self, norm, **kwargs):
        super().__init__(**kwargs)
        self.norm = norm

    def call(self, x):
        return x + 1000.0 * self.norm(x)


def test_a_hand_off_survives_saving_and_ends_where_the_model_changes(tmp_path):
    """The model saves and loads (the hand-off is no attribute of the layer's
    for Keras's saving to walk); a Sequential's `pop` and `add` end it; a
    norm that a layer of the user's own code also calls hands it nothing."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="d1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(16, name="d2"),
            keras.layers.Dense(4, name="d3"),
        ]
    )
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    model.compile(optimizer="adam", loss="mse", amp_level="O2", amp_dtype="bfloat16")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x))
    )
    model.pop()
    model.pop()
    model.add(keras.layers.Dense(4, name="head", dtype="float32"))
    seen, _ = _returned_dtypes(model, x, ["bn"])
    assert seen == {"bn": "float32"}, seen

    inputs = keras.Input((8,))
    norm = keras.layers.LayerNormalization(name="norm")
    a = keras.layers.Dense(4, name="a")(keras.layers.Dense(16, name="b")(norm(inputs)))
    shared = keras.Model(inputs, [a, keras.layers.Dense(4, name="c")(_Residual(norm)(inputs))])
    keras_mp.apply_amp(shared, "O2", "bfloat16")
    rules = {r["layer"].split("/")[-1]: r["rule"] for r in keras_mp.precision_summary(shared).rows}
    assert "consumers" not in rules["norm"], rules
