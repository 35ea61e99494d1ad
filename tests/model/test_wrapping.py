"""Your own training code: after `apply_amp`, a `compile` of the model's own
leaves no optimizer bare, wherever the model keeps it (`wrapping.py`).

The models are keras-io's, as users copy them (`tests/keras_io.py`): the
distiller's `compile(optimizer, metrics, student_loss_fn, ...)`, the DCGAN's
`compile(d_optimizer, g_optimizer, loss_fn)` with its own `train_step`.
References: the same code at O0 (float32), and Keras's own behaviour (a
bare Adam on bfloat16 weights never moves them).
"""

import functools
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.model import wrapping
from tests import keras_io

BACKEND = keras.backend.backend()
needs_stateful_fit = pytest.mark.skipif(
    BACKEND == "jax", reason="JAX's fit carries one optimizer's state (examples/gan.py loops)"
)


def _fit_quietly(model, x, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, *args, verbose=0, **kwargs)
    return history, [str(w.message) for w in caught]


# -- a compile of its own, one optimizer --------------------------------------


def _distiller_fit(level, dtype):
    """keras-io's distiller after `apply_amp` and its own compile, 3 epochs
    of the digits: the model, its student's weights before, the losses."""
    x, y = keras_io.digits()
    model = keras_io.distiller()
    keras_mp.apply_amp(model, level, dtype)
    keras_io.compile_distiller(model)
    before = keras_io.weights_of(model.student)
    history = model.fit(x, y, epochs=3, batch_size=64, verbose=0)
    return model, before, history.history["loss"]


@functools.lru_cache(maxsize=None)
def _distiller_o0_losses():
    """The float32 run every level is compared with (one per process)."""
    return tuple(_distiller_fit("O0", "float16")[2])


# The distiller's cell a backend: the wrapper's decision is the same code on
# each, each backend's step trains it. O3 bfloat16's float32 master copies on
# JAX, where the GANs' and Forward-Forward's tests (which run every level on
# the others) do not run.
DISTILLER_CELL = {
    "jax": ("O3", "bfloat16", False, True),
    "tensorflow": ("O1", "float16", True, False),
    "torch": ("O2", "float16", True, False),
}


@pytest.mark.parametrize("level, dtype, dynamic, masters", [DISTILLER_CELL[BACKEND]])
def test_the_distiller_learns_after_apply_amp_with_its_own_compile(level, dtype, dynamic, masters):
    """keras-io's distiller, after `apply_amp` as README says for a compile
    of one's own: before, at O3 bfloat16 its bare Adam never moved a weight
    (bias correction rounds to 1 in bfloat16) and the loss stood still."""
    reference = _distiller_o0_losses()
    model, before, losses = _distiller_fit(level, dtype)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer)
    assert optimizer.dynamic is dynamic
    assert optimizer.config.checks_finite
    if masters:  # float32 copies of the bfloat16 weights
        # All of the student's weights, its output layer's too (it returns float32).
        assert {v.dtype for v in model.student.trainable_weights} == {"bfloat16"}
        assert optimizer._masters is not None
    assert keras_io.moved(before, keras_io.weights_of(model.student)) == len(before)
    assert losses[-1] < 0.7 * losses[0]  # it learns ...
    np.testing.assert_allclose(losses, reference, rtol=0.1)  # ... as float32 does


# -- two optimizers ------------------------------------------------------------


# How far each network's updates may be from float32's, over their size,
# after the DCGAN's two epochs (measured: 0.043 in float16, 0.09 in bfloat16).
DCGAN_TOLERANCE = {"float16": 0.1, "bfloat16": 0.25}
_DCGAN_FLOAT32 = []


def _dcgan_float32_updates():
    """The float32 DCGAN's updates of (discriminator, generator), two epochs;
    once per process."""
    if not _DCGAN_FLOAT32:
        x, _ = keras_io.digits()
        model = keras_io.gan()
        keras_io.compile_gan(model)
        networks = (model.discriminator, model.generator)
        before = [keras_io.weights_of(n) for n in networks]
        model.fit(x, epochs=2, batch_size=64, verbose=0)
        _DCGAN_FLOAT32.extend(
            [a - b for a, b in zip(keras_io.weights_of(n), old)] for n, old in zip(networks, before)
        )
    return _DCGAN_FLOAT32


@needs_stateful_fit
@pytest.mark.parametrize(
    "level, dtype, scaled",
    [
        ("O2", "float16", True),
        ("O2", "float16", False),
        ("O3", "bfloat16", False),
    ],
    ids=[
        "O2-float16-scale_loss",
        "O2-float16-as-written",
        "O3-bfloat16-as-written",
    ],
)
def test_the_dcgan_trains_both_networks_with_its_two_optimizers(level, dtype, scaled, capsys):
    """keras-io's DCGAN (Keras's guide's on PyTorch): `compile(d_optimizer,
    g_optimizer, loss_fn)` and its own `train_step`. Each optimizer is wrapped
    before the first fit, each logs its scale and skips under its own name,
    keras_mp says so once, and both networks learn. As written (no
    `scale_loss`) at float16 the gradients are applied unscaled, with a
    warning naming the line to add; before, both optimizers were bare (at O3
    bfloat16 none of the 18 weights moved). Each network's updates follow
    the float32 DCGAN's."""
    x, _ = keras_io.digits()
    model = keras_io.gan(scaled=scaled)
    keras_mp.apply_amp(model, level, dtype)
    keras_io.compile_gan(model)
    d_before = keras_io.weights_of(model.discriminator)
    g_before = keras_io.weights_of(model.generator)
    history, told = _fit_quietly(model, x, epochs=2, batch_size=64)
    # Each network's updates follow float32's (its latent draws are seeded),
    # within its half dtype's tolerance: a network left untrained is 1 away.
    reference = _dcgan_float32_updates()
    for network, before, want in zip(
        (model.discriminator, model.generator), (d_before, g_before), reference
    ):
        got = [a - b for a, b in zip(keras_io.weights_of(network), before)]
        assert _relative_distance(got, want) < DCGAN_TOLERANCE[dtype], network.name

    for name in ("d_optimizer", "g_optimizer"):
        optimizer = getattr(model, name)
        assert isinstance(optimizer, keras_mp.LossScaleOptimizer), name
        assert optimizer.dynamic is (dtype == "float16")
        assert optimizer.config.checks_finite
        assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 0 or dtype == "float16"
        assert f"{name}_loss_scale" in history.history
        assert f"{name}_skipped_steps" in history.history
        unscaled = [t for t in told if f"self.{name}.scale_loss(loss)" in t]
        assert len(unscaled) == (1 if dtype == "float16" and not scaled else 0), told
    # The `optimizer` its `compile` leaves unused is not in the logs.
    assert "loss_scale" not in history.history
    scale = history.history["d_optimizer_loss_scale"][-1]
    assert scale > 1.0 if dtype == "float16" else scale == 1.0
    assert keras_io.moved(d_before, keras_io.weights_of(model.discriminator)) == len(d_before)
    assert keras_io.moved(g_before, keras_io.weights_of(model.generator)) == len(g_before)
    assert all(np.isfinite(history.history["d_loss"] + history.history["g_loss"]))

    said = capsys.readouterr().out
    assert said.count("keras_mp: wrapped") == 1, said
    assert "`d_optimizer` (Adam" in said and "`g_optimizer` (Adam" in said
    summary = keras_mp.precision_summary(model)
    assert {"d_optimizer", "g_optimizer"} <= {row["optimizer"] for row in summary.optimizers}
    assert "d_optimizer" in summary.text


def _gan_whose_discriminator_always_overflows():
    """keras-io's GAN at O2 float16 (with `scale_loss`), its discriminator's
    optimizer at a fixed scale of 2**100: every one of its steps overflows."""
    model = keras_io.gan(scaled=True)
    keras_mp.apply_amp(model, "O2", "float16")
    d_optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(3e-3), dynamic=False, initial_scale=2.0**100
    )
    keras_io.compile_gan(model, d_optimizer=d_optimizer)
    return model


@needs_stateful_fit
def test_a_skipped_step_of_one_optimizer_leaves_the_other_network_training():
    """Each optimizer decides for itself: the discriminator's, at a fixed
    scale of 2**100, overflows in float16 at every step and is skipped, its
    weights and slots bit-identical; the generator's own steps go on."""
    x, _ = keras_io.digits(128)
    model = _gan_whose_discriminator_always_overflows()
    d_before = keras_io.weights_of(model.discriminator)
    g_before = keras_io.weights_of(model.generator)
    history, _ = _fit_quietly(model, x, epochs=1, batch_size=32)

    steps = 4
    assert history.history["d_optimizer_skipped_steps"] == [steps]
    assert history.history["g_optimizer_skipped_steps"] == [0]
    assert keras_io.moved(d_before, keras_io.weights_of(model.discriminator)) == 0
    inner = model.d_optimizer.inner_optimizer
    assert int(keras.ops.convert_to_numpy(inner.iterations)) == 0
    for slot in inner.variables:
        value = keras.ops.convert_to_numpy(slot)
        assert not np.any(value) or slot is inner.iterations or "learning_rate" in slot.path
    assert keras_io.moved(g_before, keras_io.weights_of(model.generator)) == len(g_before)


def test_optimizers_in_a_list_or_a_dict_are_wrapped_too():
    """A compile of one's own may keep its optimizers in a list or a dict;
    each is wrapped once, and named after where it is."""

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(4)
            self.head = keras.layers.Dense(1)

        def call(self, x):
            return self.head(self.body(x))

        def compile(self, optimizers, by_role, **kwargs):
            super().compile(optimizer=optimizers[0], **kwargs)
            self.optimizers = optimizers
            self.by_role = by_role

    model = TwoHeads()
    keras_mp.apply_amp(model, "O2", "float16")
    first, second, third = (keras.optimizers.SGD(0.1) for _ in range(3))
    model.compile([first, second], {"head": third}, loss="mse")
    x = np.ones((8, 3), "float32")
    model.fit(x, np.zeros((8, 1), "float32"), epochs=1, verbose=0)
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is first
    assert model.optimizers[0] is model.optimizer  # the same one, wrapped once
    assert model.optimizers[1].inner_optimizer is second
    assert model.by_role["head"].inner_optimizer is third
    labels = {row["optimizer"] for row in keras_mp.precision_summary(model).optimizers}
    assert {"optimizer", "optimizers[1]", "by_role['head']"} <= labels


def test_compile_with_auto_scale_loss_false_leaves_the_optimizer_bare():
    model = keras_io.classifier(4, "c")
    keras_mp.apply_amp(model, "O2", "float16")
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    x, y = keras_io.digits(32)
    model.fit(x, keras.ops.one_hot(y, 10), epochs=1, verbose=0)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


# -- a non-finite step is skipped at every half level ----------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"amp_level": "O2", "amp_dtype": "bfloat16"},
        {"amp_level": "O1", "amp_dtype": "bfloat16"},
        {"amp_level": "O3", "amp_dtype": "bfloat16"},
        {"amp_level": "O2", "amp_dtype": "bfloat16", "loss_scale": None},
    ],
    ids=["O2", "O1", "O3", "O2-opted-out"],
)
def test_a_nan_batch_is_skipped_in_bfloat16_too(kwargs):
    """bfloat16 needs no loss scale, but a NaN batch still poisoned every
    weight for good (so under Keras's own mixed_bfloat16). Now it is
    skipped and counted at every half level; `loss_scale=None` opts out at
    O1 and O2 (no check, no wrapper)."""
    from tests.models import dense_bn_classifier
    from tests.models import three_class_data

    x, y = three_class_data(32)
    x[8:16] = np.nan  # the second batch
    model = dense_bn_classifier()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    model.fit(x[:8], y[:8], batch_size=8, verbose=0)  # builds; a clean step
    model.fit(x[8:], y[8:], batch_size=8, shuffle=False, verbose=0)
    finite = all(np.all(np.isfinite(w)) for w in model.get_weights())
    if "loss_scale" in kwargs:
        assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert not finite  # what the guard prevents
    else:
        assert finite
        assert int(keras.ops.convert_to_numpy(model.optimizer.skipped_steps)) == 1
        assert float(keras.ops.convert_to_numpy(model.optimizer.loss_scale)) == 1.0


@needs_stateful_fit
def test_a_gan_resumes_exactly_from_its_saved_weights(tmp_path):
    """Save a GAN that trained, build it again as its script does (apply_amp,
    its own compile), `load_weights`, train on: both optimizers' scales,
    counters and slots come back, and the run goes on as if never stopped.
    Keras skips an optimizer that is not built yet when it loads ("the
    optimizer has not been called/built yet"): a GAN's are built at their
    first step."""
    x, _ = keras_io.digits(128)

    def made():
        model = keras_io.gan(scaled=True)
        keras_mp.apply_amp(model, "O2", "float16")
        # A scale that grows every 2 steps: the saved one differs from 2**15.
        keras_io.compile_gan(
            model,
            d_optimizer=keras.optimizers.Adam(3e-3),
            g_optimizer=keras_mp.LossScaleOptimizer(
                keras.optimizers.Adam(3e-3), dynamic_growth_steps=2
            ),
        )
        return model

    model = made()
    model.fit(x, epochs=1, batch_size=32, shuffle=False, verbose=0)
    path = str(tmp_path / "gan.weights.h5")
    model.save_weights(path)
    resumed = made()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_weights(path)
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    # The GAN's noise comes from a SeedGenerator, which Keras does not save
    # with the weights: the same stream for both.
    resumed.seed_generator.state.assign(model.seed_generator.state)
    for m in (model, resumed):
        m.fit(x, epochs=1, batch_size=32, shuffle=False, verbose=0)
    for name in ("d_optimizer", "g_optimizer"):
        want, got = getattr(model, name), getattr(resumed, name)
        assert isinstance(got, keras_mp.LossScaleOptimizer), name
        assert len(got.variables) == len(want.variables)
        for a, b in zip(want.variables, got.variables):
            np.testing.assert_array_equal(
                keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), err_msg=a.path
            )
    assert float(keras.ops.convert_to_numpy(resumed.g_optimizer.loss_scale)) > 2.0**15
    for a, b in zip(model.weights, resumed.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), err_msg=a.path
        )


@needs_stateful_fit
def test_overflow_guard_watches_each_optimizer_and_names_the_one_that_stops():
    """A discriminator whose every step overflows (a fixed scale of 2**100)
    stops the run, though the model's own `optimizer` (which the GAN's
    `compile` leaves unused) never skips."""
    from keras_mp.callbacks import OverflowGuard

    x, _ = keras_io.digits(256)
    model = _gan_whose_discriminator_always_overflows()
    guard = OverflowGuard(patience=3, verbose=0)
    history, _ = _fit_quietly(model, x, epochs=1, batch_size=32, callbacks=[guard])
    assert guard.stopped_step == 2, guard.message  # the third step, counted from 0
    assert "`d_optimizer`: 3 steps in a row were skipped" in guard.message
    assert history.history["g_optimizer_skipped_steps"] == [0]


# -- optimizers held by layers: keras-io's Forward-Forward ------------------------


def _ff_fit(level, dtype, x, y, **kwargs):
    """keras-io's Forward-Forward network after `apply_amp`, fitted."""
    model = keras_io.forward_forward()
    if level != "O0":
        keras_mp.apply_amp(model, level, dtype)
    keras_io.compile_ff(model)
    before = [keras_io.weights_of(layer.dense) for layer in keras_io.ff_layers(model)]
    history, told = _fit_quietly(model, x, y, batch_size=128, shuffle=False, **kwargs)
    return model, before, history.history, told


@functools.lru_cache(maxsize=None)
def _ff_o0_losses():
    """The float32 run every level is compared with (one per process)."""
    x, y = keras_io.digits()
    return tuple(_ff_fit("O0", "float16", x, y, epochs=3)[2]["FinalLoss"])


@needs_stateful_fit
@pytest.mark.parametrize(
    "level, dtype, dynamic, masters",
    # O1's first layer has O2's dynamic scale; its second computes float32.
    [("O1", "float16", True, False), ("O3", "bfloat16", False, True)],
)
def test_each_layers_own_optimizer_is_wrapped_named_and_trains(level, dtype, dynamic, masters):
    """Forward-Forward's `FFDense` layers each step their own Adam in the
    model's `train_step`. Before, each stayed bare at every level: at O3
    bfloat16 FinalLoss stood still (no weight moved) and in float16 the logs
    held only the model optimizer's scale, which the step never applies.
    Now each is wrapped as its layer's precision needs, logged under its
    layer's name, listed by precision_summary, and learns as float32 does.
    At O1 float16 the second layer computes all in float32 (its Dense by the
    head rule, its ReLU off the allow-list): its Adam, left bare there
    before, gets the skip without a scale."""
    x, y = keras_io.digits()
    reference = {"FinalLoss": _ff_o0_losses()}
    model, before, logs, told = _ff_fit(level, dtype, x, y, epochs=3)
    summary = keras_mp.precision_summary(model)
    rows = {row["optimizer"]: row for row in summary.optimizers}
    in_float32 = [
        not {layer.dense.compute_dtype, layer.relu.compute_dtype} - {"float32"}
        for layer in keras_io.ff_layers(model)
    ]
    assert in_float32 == [False, level == "O1"]  # the cell that left it bare
    for layer, weights, float32 in zip(keras_io.ff_layers(model), before, in_float32):
        optimizer = layer.optimizer
        label = f"{layer.name}.optimizer"
        assert isinstance(optimizer, keras_mp.LossScaleOptimizer), label
        assert optimizer.dynamic is (dynamic and not float32)
        assert optimizer.config.checks_finite
        assert (optimizer._masters is not None) is masters
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 3 * 2 * 5
        assert keras_io.moved(weights, keras_io.weights_of(layer.dense)) == len(weights)
        assert f"{label}_loss_scale" in logs and f"{label}_skipped_steps" in logs
        assert rows[label]["class"] == "LossScaleOptimizer(Adam)"
        # FF's loss never reaches `scale_loss`: in float16 the warning names
        # the line in the layer's own code.
        line = f"`self.optimizer` (in FFDense `{layer.name}`)"
        assert sum(line in t for t in told) == (1 if optimizer.dynamic else 0), told
    assert "loss_scale" not in logs  # the model's `optimizer`: never applied
    assert logs["FinalLoss"][-1] < logs["FinalLoss"][0]
    np.testing.assert_allclose(logs["FinalLoss"], reference["FinalLoss"], rtol=0.02)


@needs_stateful_fit
def test_a_nan_batch_skips_every_layers_step_and_changes_nothing():
    """A NaN batch reaches each FFDense step: each layer's optimizer skips
    its five steps (its weights, slots and iterations as after the clean
    batch alone, bit for bit), the step's own counters are put back, and
    OverflowGuard names the layer's optimizer that stops a run of them.
    Before, the bare Adams applied it: every weight NaN. At O1 float16 the
    second layer computes all in float32, and its Adam skips all the same."""
    from keras_mp.callbacks import OverflowGuard

    x, y = keras_io.digits(256)
    x = x.copy()
    x[128:] = np.nan  # the second batch
    clean, _, _, _ = _ff_fit("O1", "float16", x[:128], y[:128], epochs=1)
    model, _, logs, _ = _ff_fit("O1", "float16", x, y, epochs=1)
    for want, got in zip(keras_io.ff_layers(clean), keras_io.ff_layers(model)):
        assert logs[f"{got.name}.optimizer_skipped_steps"] == [5]
        for a, b in zip(
            want.optimizer.inner_optimizer.variables, got.optimizer.inner_optimizer.variables
        ):
            np.testing.assert_array_equal(
                keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), err_msg=a.path
            )
        for a, b in zip(keras_io.weights_of(want), keras_io.weights_of(got)):
            np.testing.assert_array_equal(a, b)
    # The step's own counters (its non-trainable variables) are put back too
    # (the batch's logs were computed before, from the NaN).
    for name in ("loss_var", "loss_count"):
        want, got = (keras.ops.convert_to_numpy(getattr(m, name)) for m in (clean, model))
        np.testing.assert_array_equal(want, got)

    guard = OverflowGuard(patience=3, verbose=0)
    x[:128] = np.nan
    model, _, _, _ = _ff_fit("O1", "float16", x, y, epochs=1, callbacks=[guard])
    first = keras_io.ff_layers(model)[0].name
    assert guard.stopped_step is not None
    assert f"`{first}.optimizer`: " in guard.message, guard.message


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's fit carries model.optimizer's state only")
def test_jax_fit_refuses_a_step_that_applies_a_layers_optimizer_and_says_what_works():
    """On JAX, Keras's compiled `fit` step carries `model.optimizer`'s
    state only; a step that trains with a layer's own optimizer is refused
    with its name and the loop that works, not a bare TypeError."""
    x, y = keras_io.digits(128)
    model = keras_io.forward_forward()
    keras_mp.apply_amp(model, "O2", "float16")
    keras_io.compile_ff(model)
    with pytest.raises(ValueError) as raised:
        model.fit(x, y, batch_size=128, verbose=0)
    for layer in keras_io.ff_layers(model):
        assert f"`{layer.name}.optimizer`" in str(raised.value)
    assert "stateless_apply" in str(raised.value) and "examples/gan.py" in str(raised.value)


def test_find_optimizers_looks_in_layers_and_nested_models():
    """Optimizers are found in the model's attributes, its layers' and its
    nested models', each once, labelled after where it is held."""

    class Owner(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(2)
            self.optimizer = keras.optimizers.SGD()
            self.spare = [keras.optimizers.Adam()]

        def call(self, x):
            return self.dense(x)

    inner = keras.Sequential([keras.Input((3,)), Owner(name="owner")], name="inner")
    inner.compile(optimizer="adam", loss="mse")
    outer = keras.Sequential([keras.Input((3,)), inner], name="outer")
    outer.compile(optimizer="sgd", loss="mse")
    labels = [held.label for held in wrapping.find_optimizers(outer)]
    assert labels == ["optimizer", "inner.optimizer", "owner.optimizer", "owner.spare[0]"]
    owner = inner.get_layer("owner")
    held = wrapping.find_optimizers(outer)[2]
    assert held.holder is owner and held.attribute == "optimizer"
    new = keras.optimizers.SGD()
    held.setter(new)
    assert owner.optimizer is new


# -- keras-io's WGAN-GP and CycleGAN: more optimizers, as written ----------------------


def _trainable(network):
    return [np.array(keras.ops.convert_to_numpy(w), "float32") for w in network.trainable_weights]


def _unmoved(before, networks):
    """The trainable weights that did not move (by position)."""
    return [
        (i, j)
        for i, (old, net) in enumerate(zip(before, networks))
        for j, (a, b) in enumerate(zip(old, _trainable(net)))
        if np.array_equal(a, b)
    ]


# How far a level's updates may be from float32's, over their size: the
# WGAN-GP's epoch (4 generator and 12 critic steps) at O2 float16 and O3
# bfloat16 measured 0.04 and 0.06; its gradient penalty at half its weight
# moves them by 0.36.
WGAN_TOLERANCE = 0.1


def _wgan_run(level=None, dtype=None, dropout_dtype=None, gp_weight=10.0, eager=True):
    """keras-io's WGAN-GP trained one epoch: its model, its networks'
    updates and logs. Op by op (`eager`), its unseeded `tf.random.normal`
    draws are the same from run to run; in a graph they depend on the ops
    before them. `dropout_dtype`: the float32 model with its Dropout layers
    drawing their masks in that dtype, as they do at a level (a mask drawn
    in float16 is another mask), the reference a level is compared with."""
    x, _ = keras_io.digits(128)
    model = keras_io.wgan()
    model.gp_weight = gp_weight
    if dropout_dtype:
        for layer in model.discriminator.layers:
            if isinstance(layer, keras.layers.Dropout):
                layer.dtype_policy = keras.DTypePolicy(dropout_dtype)
    if level is not None:
        keras_mp.apply_amp(model, level, dtype)
    keras_io.compile_wgan(model)
    model.run_eagerly = eager
    networks = (model.discriminator, model.generator)
    before = [_trainable(n) for n in networks]
    history, _ = _fit_quietly(model, x * 2.0 - 1.0, epochs=1, batch_size=32, shuffle=False)
    updates = [a - b for n, old in zip(networks, before) for a, b in zip(_trainable(n), old)]
    return model, before, updates, history.history


def _relative_distance(got, want):
    got = np.concatenate([u.ravel() for u in got])
    want = np.concatenate([u.ravel() for u in want])
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras-io's WGAN-GP: TensorFlow")
@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_keras_io_wgan_gp_follows_float32_as_written(level, dtype):
    """Its gradient penalty (a tape inside the tape) and three discriminator
    steps per generator step: both optimizers wrapped, and every update of
    both networks follows float32's, step by step, within the tolerance a
    half dtype leaves, which the penalty at half its weight exceeds threefold.
    (Keras's own mixed policy fails on it: the generator's float16 images
    minus the float32 real ones.)"""
    _, _, reference, _ = _wgan_run(dropout_dtype=dtype)
    model, _, updates, logs = _wgan_run(level, dtype)
    for name in ("d_optimizer", "g_optimizer"):
        assert isinstance(getattr(model, name), keras_mp.LossScaleOptimizer), name
        assert f"{name}_skipped_steps" in logs
    assert _relative_distance(updates, reference) < WGAN_TOLERANCE
    if level == "O2":
        _, _, half_penalty, _ = _wgan_run(dropout_dtype=dtype, gp_weight=5.0)
        assert _relative_distance(half_penalty, reference) > 3 * WGAN_TOLERANCE


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras-io's WGAN-GP: TensorFlow")
def test_keras_io_wgan_gp_trains_compiled():
    """In a graph (`fit`'s default): every weight moves as at O0 (the
    critic's last bias gets a zero gradient: a difference of means) and the
    losses are finite."""
    model, before, _, logs = _wgan_run("O2", "float16", eager=False)
    assert _unmoved(before, (model.discriminator, model.generator)) == [(0, 5)]
    assert all(np.isfinite(logs[key]).all() for key in ("d_loss", "g_loss"))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras-io's CycleGAN: TensorFlow")
@pytest.mark.parametrize("level, dtype", [("O2", "float16")])
def test_keras_io_cyclegan_trains_its_four_networks_as_written(level, dtype):
    """Four optimizers in one `compile` of its own, one persistent tape, a
    padding layer of its own (`tf.pad`): each optimizer wrapped and logged,
    each network learns, the losses follow the O0 float32 run's."""
    horses, zebras = keras_io.cyclegan_data()

    def run(level):
        model = keras_io.cyclegan()
        if level != "O0":
            keras_mp.apply_amp(model, level, dtype)
        keras_io.compile_cyclegan(model)
        # Op by op: tracing four networks' steps costs 20 s, seven times its
        # four steps (CI time). A compiled step of a model's own with several
        # optimizers: test_keras_io_wgan_gp_trains_compiled.
        model.run_eagerly = True
        networks = (model.gen_G, model.gen_F, model.disc_X, model.disc_Y)
        before = [_trainable(n) for n in networks]
        import tensorflow as tf

        dataset = tf.data.Dataset.zip(
            tuple(tf.data.Dataset.from_tensor_slices(d).batch(16) for d in (horses, zebras))
        )
        history, _ = _fit_quietly(model, dataset, epochs=1)
        return model, before, networks, history.history

    _, _, _, reference = run("O0")
    model, before, networks, logs = run(level)
    for name in ("gen_G", "gen_F", "disc_X", "disc_Y"):
        assert isinstance(getattr(model, f"{name}_optimizer"), keras_mp.LossScaleOptimizer), name
        assert f"{name}_optimizer_loss_scale" in logs
    assert _unmoved(before, networks) == []
    for key in ("G_loss", "F_loss", "D_X_loss", "D_Y_loss"):
        assert np.isfinite(logs[key]).all(), key
        np.testing.assert_allclose(logs[key], reference[key], rtol=0.1, err_msg=key)
