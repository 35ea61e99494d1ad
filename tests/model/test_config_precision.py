"""Each layer's precision in the model's own config (`config_precision.py`):
every road back to a model (`save`/`load_model`, `from_config(get_config())`,
`clone_model`) computes as the model did, bit for bit, whether its precision
came from `compile(amp_level=...)` or from `apply_amp` alone; a sub-model
saved on its own too."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp
from tests.saving import SHAPES
from tests.saving import AttendingNet
from tests.saving import assert_computes_as
from tests.saving import outputs
from tests.saving import precision
from tests.saving import shape


def _with_weights_of(model, rebuilt, x):
    if not rebuilt.built:
        rebuilt(x[:1])
    rebuilt.set_weights(model.get_weights())
    return rebuilt


ROADS = {
    "load_model": lambda model, x, path: keras.models.load_model(path),
    "from_config": lambda model, x, path: _with_weights_of(
        model, type(model).from_config(model.get_config()), x
    ),
    "clone_model": lambda model, x, path: _with_weights_of(
        model, keras.models.clone_model(model), x
    ),
}


def _cell(name, compiled):
    """Which layers get which record is decided before any backend computes:
    each shape once; every road on each backend with the smallest model."""
    on_each = name == "sequential_softmax_head" and not compiled
    return pytest.param(
        name,
        compiled,
        id=f"{name}-{'compiled' if compiled else 'apply_amp'}",
        marks=[] if on_each else [pytest.mark.one_backend],
    )


@pytest.mark.parametrize(
    "name, compiled", [_cell(name, compiled) for name in SHAPES for compiled in (False, True)]
)
def test_every_road_back_computes_as_the_model_did(tmp_path, name, compiled):
    """Only a model that came through `compile(amp_level=...)` came back in
    its precision from `load_model` and `clone_model`, and none from
    `from_config`: a softmax head computed in half and returned half (up to
    6e-4 away), an attention's softmax in half, a GRU's head in bfloat16
    (2e-3), each layer "Keras default" in `precision_summary`."""
    model, x = shape(name, compiled)
    path = str(tmp_path / "model.keras")
    model.save(path)
    # A compiled model's `load_model` came back exact before, with
    # `compile=False` too (`test_saved_precision.py`, the zoo).
    roads = ["from_config", "clone_model"] if compiled else list(ROADS)
    _assert_every_road_computes_as(model, x, path, roads)


def _assert_every_road_computes_as(model, x, path, roads=tuple(ROADS)):
    expected = outputs(model, x)
    for road in roads:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no record that does not fit
            warnings.filterwarnings("ignore", "The structure of `inputs`")
            rebuilt = ROADS[road](model, x, path)
        try:
            assert_computes_as(rebuilt, model, x, expected)
        except AssertionError as error:
            raise AssertionError(f"{road}: {error}") from None


@pytest.mark.one_backend
def test_a_sub_model_saved_on_its_own_keeps_the_precision_its_parent_gave(tmp_path):
    """The GAN's and the VAE's pattern: an encoder used inside the model
    compiled at O2, then saved on its own. Its sigmoid came back in half,
    its outputs half, 7e-4 away."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    code = keras.layers.Dense(4, activation="sigmoid")(keras.layers.Dense(8)(inputs))
    encoder = keras.Model(inputs, code, name="encoder")
    outer = keras.Input((6,))
    full = keras.Model(outer, keras.layers.Dense(2)(encoder(outer)))
    full.compile("adam", "mse", amp_level="O2")
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32") * 4
    path = str(tmp_path / "encoder.keras")
    encoder.save(path)
    _assert_every_road_computes_as(encoder, x, path)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class OwnFromConfig(AttendingNet):
    """`from_config` as Keras's guides write it for a model of your own: the
    config straight to the constructor, without Keras's `from_config`."""

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@pytest.mark.one_backend
def test_a_from_config_of_your_own_class_gives_it_back_too(tmp_path):
    keras.utils.set_random_seed(0)
    model = OwnFromConfig()
    x = np.random.default_rng(0).normal(size=(8, 4, 8)).astype("float32") * 4
    model(x[:1])
    keras_mp.apply_amp(model, "O3")
    path = str(tmp_path / "model.keras")
    model.save(path)
    _assert_every_road_computes_as(model, x, path)


@pytest.mark.one_backend
def test_a_model_keras_mp_did_not_set_keeps_keras_config():
    """`import keras_mp` changes nothing else: a model keras_mp never set
    the precision of, or set at O0 (Keras's configs rebuild it exactly),
    has Keras's own config."""
    model, _ = shape("functional_attention", compiled=False)
    assert "dtype" in model.get_config()
    keras.utils.set_random_seed(0)
    plain = SHAPES["functional_attention"][0]()
    assert "dtype" not in plain.get_config()
    keras_mp.apply_amp(plain, "O0")
    assert "dtype" not in plain.get_config()


@pytest.mark.one_backend
def test_a_clone_whose_layers_differ_says_it_was_not_given_the_precision():
    """A `clone_function` that makes other layers: the record cannot be
    applied by position, and the clone says so rather than computing in a
    precision nobody chose."""
    model, _ = shape("sequential_softmax_head", compiled=False)

    def other_layers(layer):
        if isinstance(layer, keras.layers.Dense):
            return keras.layers.EinsumDense("ab,bc->ac", (layer.units,))
        return layer.__class__.from_config(layer.get_config())

    with pytest.warns(UserWarning, match="clone_model rebuilt model .* not given back"):
        clone = keras.models.clone_model(model, clone_function=other_layers)
    assert {r[3] for r in precision(clone)} == {"Keras default"}


def _gpt2_backbone():
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=61,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=16,
    )
    ids = np.random.default_rng(0).integers(1, 61, (2, 8)).astype("int32")
    return backbone, {"token_ids": ids, "padding_mask": np.ones((2, 8), bool)}


@pytest.mark.one_backend
def test_a_keras_hub_causal_lm_comes_back_from_its_config():
    """A KerasHub task and its backbone write their configs without
    `Model.get_config`, and the backbone's `from_config` passes its config to
    the constructor, which builds the graph and then sets the model's
    policy. `GPT2CausalLM.from_config(get_config())` of a model at O2 came
    back entirely in float32 ("Keras default" on every layer, 5e-4 away),
    silently; Keras's own `mixed_bfloat16` round-trips exactly."""
    import keras_hub

    backbone, x = _gpt2_backbone()
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    keras_mp.apply_amp(model, "O2", dtype="bfloat16")
    config = keras.saving.serialize_keras_object(model)
    for road, rebuild in {
        "from_config": lambda: type(model).from_config(model.get_config()),
        "deserialize": lambda: keras.saving.deserialize_keras_object(config),
    }.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no record that does not fit
            # Keras's, for a task's own `compile` (KerasHub's tasks have one).
            warnings.filterwarnings("ignore", "`compile\\(\\)` was not called")
            rebuilt = rebuild()
        rebuilt.set_weights(model.get_weights())
        try:
            assert_computes_as(rebuilt, model, x)
        except AssertionError as error:
            raise AssertionError(f"{road}: {error}") from None


@pytest.mark.one_backend
def test_a_keras_hub_model_rebuilt_at_o1_comes_back_again():
    """At O1 a KerasHub model keeps the policy it was built under, which
    its config rebuilds: the rebuilt model's config no longer carried the
    record, and rebuilding it again (or saving it and loading the file)
    came back entirely "Keras default", 1.8e-4 away."""
    model, x = _gpt2_backbone()
    keras_mp.apply_amp(model, "O1", dtype="float16")
    rebuilt = type(model).from_config(model.get_config())
    again = type(rebuilt).from_config(rebuilt.get_config())
    again.set_weights(model.get_weights())
    assert_computes_as(again, model, x)


class _BuiltInItsConstructor(keras.Model):
    """A functional model of your own whose constructor takes no `dtype`
    (no `**kwargs`) and whose `get_config` builds its dict from scratch."""

    def __init__(self, units=4):
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8)(inputs)
        super().__init__(inputs, keras.layers.Dense(units, activation="softmax")(hidden))
        self.units = units

    def get_config(self):
        return {"units": self.units}


@pytest.mark.one_backend
def test_a_config_that_cannot_carry_the_precision_says_so():
    """Its config has no room for the record: rebuilt from it, the model
    computed in float32, 4.4e-4 away, without a word."""
    model = _BuiltInItsConstructor()
    keras_mp.apply_amp(model, "O2", "float16")
    with pytest.warns(UserWarning, match="cannot carry the precision .* takes none"):
        config = model.get_config()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert model.get_config() == config  # said once
