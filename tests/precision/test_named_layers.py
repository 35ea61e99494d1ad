"""A string in `allow`/`deny` (`amp_allow`/`amp_deny`) that names no layer
of the model is an error naming the argument, the name and the nearest
layer names; classes and layers are not names."""

import keras
import numpy as np
import pytest

import keras_mp

pytestmark = pytest.mark.one_backend


def _model():
    """A functional model around a nested Sequential, whose layer `body`
    sits one level down."""
    inputs = keras.Input((4,))
    encoder = keras.Sequential(
        [keras.layers.Dense(8, name="hidden"), keras.layers.Dense(8, name="body")],
        name="encoder",
    )
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(encoder(inputs)))


@pytest.mark.parametrize("name", ["Body", "bdy"])
def test_a_misspelt_name_is_an_error_naming_the_nearest_layers(name):
    model = _model()
    with pytest.raises(ValueError) as info:
        keras_mp.apply_amp(model, "O2", deny=[name])
    message = str(info.value)
    assert message.startswith("`deny` names no layer of the model")
    assert "The nearest layer names: 'body'." in message
    assert f"Received: deny=[{name!r}]" in message
    # Nothing was applied: the model is as it was.
    assert model.get_layer("head").dtype_policy.name == "float32"
    # compile names its own argument.
    with pytest.raises(
        ValueError, match=r"^`amp_allow` names no layer.*'head'.*amp_allow=\['hed'\]"
    ):
        model.compile(optimizer="sgd", loss="mse", amp_level="O2", amp_allow=["hed"])


def test_a_class_name_is_told_to_pass_the_class():
    with pytest.raises(ValueError) as info:
        keras_mp.apply_amp(_model(), "O1", allow=["Dense"])
    assert "'Dense' is the name of a class" in str(info.value)
    assert "allow=[keras.layers.Dense]" in str(info.value)


def test_names_of_nested_layers_classes_and_layers_pass():
    """The whole tree is searched; classes and layer objects are not checked
    (a class the model does not hold changes nothing, as it always did)."""
    model = _model()
    keras_mp.apply_amp(
        model, "O2", deny=["body", keras.layers.Conv2D], allow=[keras.layers.Dense(2)]
    )
    assert model.get_layer("encoder").get_layer("body").dtype_policy.name == "float32"
    assert model.get_layer("encoder").get_layer("hidden").dtype_policy.name == "mixed_float16"


class _BuildsItsEncoder(keras.Model):
    """A subclassed model whose `build` creates the layer a name denies."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(1, name="out")

    def build(self, shape):
        self.encoder = keras.layers.Dense(8, name="late_encoder")
        self.encoder.build(shape)

    def call(self, x):
        return self.out(self.encoder(x))


def test_a_layer_made_in_build_is_named_once_the_model_is_built():
    """Checked when the model is built (compile, then fit), not before: the
    name of a layer its `build` creates is no error."""
    model = _BuildsItsEncoder()
    model.compile(optimizer="sgd", loss="mse", amp_level="O2", amp_deny=["late_encoder"])
    x = np.ones((4, 4), "float32")
    model.fit(x, x[:, :1], verbose=0)
    assert model.encoder.dtype_policy.name == "float32"
    assert "deny" in keras_mp.precision_summary(model).rows[-1]["rule"]
