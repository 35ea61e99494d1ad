"""Float32 master weights for half variables (O3): they learn, and lose nothing.

The references: the same model without master weights (whose bfloat16
weights do not move at small learning rates), float32 (O0) runs, and the
weights set by hand. Exact resume through a `.keras` file at O3 is in
`test_saving.py`, the optimizer features (clipping, EMA, accumulation, weight
decay) at O3 in `test_inner_optimizer.py`, digits accuracy in
`test_accuracy_parity.py`.
"""

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_mp
from tests import models

BATCH = 8


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


def _data(steps=4):
    return models.three_class_data(steps * BATCH)


def _model():
    return models.dense_bn_classifier()


def _master_copies(model):
    """The optimizer's float32 variables by name: a half variable's copy is
    named after its variable's path (`dense_kernel`)."""
    return {v.name: v for v in model.optimizer.variables if v.dtype == "float32"}


def _name(variable, suffix=None):
    name = variable.path.replace("/", "_")
    return name if suffix is None else f"{name}_{suffix}"


def _half_nonzero_weights(model):
    # Weights that start away from 0 (kernels, BatchNorm's gamma): near 0 a
    # half dtype's spacing is tiny and any update moves a weight.
    return [v for v in models.half_weights(model) if v.name in ("kernel", "gamma")]


@pytest.mark.skipif(keras.backend.backend() == "torch", reason="XLA: TensorFlow and JAX")
@pytest.mark.parametrize("master_weights", [True, "compensated"])
def test_o3_fit_compiled_by_xla_from_the_first_step(master_weights):
    """`jit_compile=True`, Keras's default for TensorFlow on a GPU.

    Without a strategy TensorFlow builds the optimizer inside the first
    traced step, so the master copies are made there; XLA refuses a variable
    whose initial value reads a tensor of the step (a copy initialised from
    its weight did: O3 failed on every TensorFlow GPU). The hidden kernel
    has more than 128 values: TensorFlow captures a smaller tensor as a
    constant, which would hide a copy initialised from a value read outside
    the step. The compiled fit trains as the uncompiled one does.
    """
    x, y = _data()

    def trained(jit_compile):
        model = models.dense_bn_classifier(width=32)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss="sparse_categorical_crossentropy",
            amp_level="O3",
            amp_dtype="bfloat16",
            master_weights=master_weights,
            jit_compile=jit_compile,
        )
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return model, history.history["loss"]

    model, losses = trained(True)
    reference, reference_losses = trained(False)
    assert np.isfinite(losses).all(), losses
    np.testing.assert_allclose(losses, reference_losses, rtol=2e-2)
    for got, want in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(_numpy(got), _numpy(want), rtol=5e-2, atol=2e-2)
    if master_weights is True:
        copies = _master_copies(model)
        for variable in models.half_weights(model):
            rounded = keras.ops.cast(copies[_name(variable)], variable.dtype)
            np.testing.assert_array_equal(_numpy(variable), _numpy(rounded))


@pytest.mark.parametrize("master_weights", [True, False, "compensated"])
def test_updates_below_bfloat16_resolution_accumulate(master_weights):
    # SGD at 1e-4: each update is far below half a bfloat16 spacing of most
    # weights (about 2**-9 of their size), so rounding in place loses it.
    x, y = _data(steps=8)

    def fit(model):
        model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)

    reference = _model()
    reference.compile(optimizer=keras.optimizers.SGD(1e-4), loss="sparse_categorical_crossentropy")
    initial = {v.path.split("/", 1)[1]: _numpy(v) for v in reference.trainable_variables}
    fit(reference)
    model = models.o3_classifier(keras.optimizers.SGD(1e-4), master_weights=master_weights)
    started = {v.path.split("/", 1)[1]: _numpy(v) for v in _half_nonzero_weights(model)}
    assert started, "O3 made no variable half"
    fit(model)
    copies = _master_copies(model)
    buffers = {v.name: v for v in model.optimizer.variables if v.name.endswith("_compensation")}
    for variable in _half_nonzero_weights(model):
        key = variable.path.split("/", 1)[1]
        # (a kernel, or BatchNorm's gamma: each layer's first weight)
        expected = _numpy(reference.get_layer(key.split("/")[0]).weights[0]) - initial[key]
        if not master_weights:
            # Rounded in place: most of float32's update is lost.
            update = _numpy(variable) - started[key]
            assert np.linalg.norm(update - expected) > 0.5 * np.linalg.norm(expected), key
            continue
        if master_weights == "compensated":
            # The variable and its buffer together hold float32's update.
            held = _numpy(variable) + _numpy(buffers[_name(variable, "compensation")])
            assert np.linalg.norm(held - started[key] - expected) < 0.2 * np.linalg.norm(expected)
            continue
        # The copy holds float32's update (its forward passes were bfloat16),
        # and the model variable holds the copy's rounding.
        copy = copies[_name(variable)]
        update = _numpy(copy) - started[key]
        assert np.linalg.norm(update - expected) < 0.2 * np.linalg.norm(expected), key
        rounded = keras.ops.cast(keras.ops.cast(copy, variable.dtype), "float32")
        np.testing.assert_array_equal(_numpy(variable), _numpy(rounded))


def test_o3_bfloat16_follows_float32_training():
    """Adam at an ordinary learning rate: O3's weights track O0's."""

    def trained(level, **amp):
        model = _model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            amp_level=level,
            amp_dtype="bfloat16",
            **amp,
        )
        x, y = _data(steps=8)
        model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
        return np.concatenate([_numpy(v).ravel() for v in model.trainable_variables])

    initial = np.concatenate([_numpy(v).ravel() for v in _model().trainable_variables])
    reference = trained("O0") - initial
    for master_weights, bound in ((True, 0.1), ("compensated", 0.1), (False, None)):
        update = trained("O3", master_weights=master_weights) - initial
        error = np.linalg.norm(update - reference) / np.linalg.norm(reference)
        if bound is not None:
            assert error < bound, error
        else:
            assert error > 0.5, error  # without the copies: far from float32


@pytest.mark.parametrize(
    "dtype, master_weights",
    # Apex's O2: half variables, float32 master weights and BatchNorm, dynamic
    # loss scaling; and its bfloat16 form with compensation buffers.
    [("float16", True), ("bfloat16", "compensated")],
)
def test_skipped_step_leaves_variables_copies_and_slots_bit_identical(
    jax_skip_form, dtype, master_weights
):
    model = models.o3_classifier(
        keras.optimizers.Adam(1e-2),
        dtype=dtype,
        loss_scale="dynamic",
        keep_batchnorm_fp32=True,
        master_weights=master_weights,
    )
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    optimizer = model.optimizer
    assert optimizer.master_weights == master_weights and optimizer.dynamic
    state = [_numpy(v) for v in model.weights + optimizer.variables]
    scale = float(_numpy(optimizer.loss_scale))
    bad = x[:BATCH].copy()
    bad[3, 2] = np.inf
    model.train_on_batch(bad, y[:BATCH])
    assert int(_numpy(optimizer.skipped_steps)) == 1
    assert float(_numpy(optimizer.loss_scale)) == scale / 2
    after = [_numpy(v) for v in model.weights + optimizer.variables]
    names = [v.path for v in model.weights + optimizer.variables]
    for name, a, b in zip(names, after, state):
        if name.endswith(("loss_scale", "good_steps", "skipped_steps")):
            continue
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weights_set_from_outside_are_kept(dtype):
    """`set_weights` after training: the next step starts from those weights.

    A copy that no longer rounds to its variable takes the variable's value;
    with a learning rate of 0 the step must leave the set weights as they are
    (a stale copy written back would restore the trained ones).
    """
    model = models.o3_classifier(keras.optimizers.SGD(1e-2), dtype=dtype)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    rng = np.random.default_rng(1)
    new = [rng.normal(size=w.shape).astype(w.dtype) for w in model.get_weights()]
    model.set_weights(new)
    expected = [_numpy(w) for w in model.trainable_variables]
    model.optimizer.learning_rate = 0.0
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_array_equal(_numpy(variable), value, err_msg=variable.path)


# A pattern judges the variable's own name ("bias"), not its copy's
# ("sequential_hidden_bias"): "^bias$" matches the one, not the other.
# (On TensorFlow Keras matches the `tf.Variable`'s name, "sequential/
# hidden/bias:0", which "^bias$" does not: at O0 as at O3.)
@pytest.mark.parametrize("pattern", ["bias", "^bias$"])
@pytest.mark.parametrize("dtype, master_weights", [("float16", True), ("bfloat16", "compensated")])
def test_weight_decay_and_its_exclusions_at_o3(dtype, master_weights, pattern):
    def trained(level):
        model = _model()
        optimizer = keras.optimizers.AdamW(1e-2, weight_decay=5.0)
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            amp_level=level,
            amp_dtype=dtype,
            **({"master_weights": master_weights} if level == "O3" else {}),
        )
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        # By variable (keyed by the object) and by name.
        inner.exclude_from_weight_decay(
            var_list=[model.get_layer("hidden").kernel], var_names=[pattern]
        )
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return [(v.path, _numpy(v)) for v in model.trainable_variables]

    for (path, o3), (_, reference) in zip(trained("O3"), trained("O0")):
        # A decay of 5% a step, if an exclusion were lost, moves its variable
        # by 0.1-0.2 of its size in 4 steps: far beyond half precision's
        # rounding, measured over the whole variable (bfloat16's forward
        # passes move a single weight by up to 0.02, as many as the CPU's
        # kernels decide).
        rtol = 3e-3 if dtype == "float16" else 3e-2
        error = np.linalg.norm(o3 - reference) / np.linalg.norm(reference)
        assert error < rtol, (path, error)


def test_master_weights_need_a_bool_and_agree_with_the_optimizer():
    with pytest.raises(TypeError, match="master_weights=1"):
        models.o3_classifier("sgd", master_weights=1)
    with pytest.raises(ValueError, match="'compensated'.*master_weights='kahan'"):
        models.o3_classifier("sgd", master_weights="kahan")
    with pytest.raises(ValueError, match="amp_dtype='float16', master_weights='compensated'"):
        models.o3_classifier("sgd", dtype="float16", master_weights="compensated")
    # Float16 variables made by hand: refused at build, naming them.
    model = _model()
    model.compile(optimizer="sgd", loss="mse", amp_level="O3", amp_dtype="float16")
    lso = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), master_weights="compensated")
    with pytest.raises(ValueError, match="these are float16.*hidden/kernel"):
        lso.build(model.trainable_variables)
    # An optimizer without a float32 rule here: refused at build, naming it.
    model = models.o3_classifier(keras.optimizers.RMSprop(), master_weights="compensated")
    with pytest.raises(ValueError, match="inner optimizer is RMSprop.*master_weights=True"):
        model.optimizer.build(model.trainable_variables)
    lso = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), master_weights=False)
    with pytest.raises(ValueError, match="master_weights=True.*optimizer.master_weights=False"):
        models.o3_classifier(lso, master_weights=True)
    with pytest.raises(ValueError, match="need `amp_level`"):
        _model().compile(optimizer="sgd", loss="mse", master_weights=True)


@pytest.mark.skipif(
    keras.backend.backend() == "jax",
    reason="CI time: each fit compiles BERT on JAX (45 s); O3's copies on JAX: "
    "test_o3_bfloat16_follows_float32_training",
)
@pytest.mark.slow(
    reason="three KerasHub BERTs built, compiled and fitted two epochs (TensorFlow: 60-95 s)"
)
def test_lora_fine_tuning_of_a_bfloat16_keras_hub_model():
    """A KerasHub BERT built in bfloat16 (`from_preset(..., dtype=...)`),
    fine-tuned with LoRA and Adam at O3 bfloat16. Keras creates LoRA weights
    in float32 whatever the layer's policy (so that fine-tuning does not
    underflow): O3 keeps them float32 whether LoRA was enabled before
    `compile` or after it, rounds the frozen kernels to bfloat16, and the
    LoRA weights move as far as in the same fine-tuning in float32."""
    pytest.importorskip("keras_hub")
    from tests.zoo import families

    def lora_updates(level, lora_first=True, **amp):
        keras.utils.set_random_seed(0)
        model, x, y, loss = families.bert(dtype="bfloat16" if level == "O3" else None)
        if lora_first:
            model.backbone.enable_lora(4)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=loss,
            amp_level=level,
            amp_dtype="bfloat16",
            **amp,
        )
        if not lora_first:
            model.backbone.enable_lora(4)
        lora = [v for v in model.trainable_variables if "lora_kernel" in v.path]
        before = [_numpy(v) for v in lora]
        model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        assert {v.dtype for v in lora} == {"float32"}
        if level == "O3":
            frozen = [v for v in model.non_trainable_variables if v.path.endswith("/kernel")]
            assert frozen and {v.dtype for v in frozen} == {"bfloat16"}
        return np.concatenate(
            [(_numpy(v) - b).ravel() for v, b in zip(lora, before) if "lora_kernel_b" in v.path]
        )

    # Adam moves each weight by about its learning rate a step: the LoRA
    # weights' updates have float32's size (their directions are mostly
    # noise on a random model and labels, in float32 already).
    reference = np.linalg.norm(lora_updates("O0"))
    assert reference > 0
    moved = np.linalg.norm(lora_updates("O3")) / reference
    assert 0.5 < moved < 2, moved
    moved = np.linalg.norm(lora_updates("O3", lora_first=False)) / reference
    assert 0.5 < moved < 2, moved


def test_state_is_named_after_its_variable(tmp_path):
    """Each master copy, Adam slot and compensation buffer names its
    variable's path: unique, readable in `optimizer.variables`, and the same
    after a `.keras` round trip."""
    model = models.o3_classifier(keras.optimizers.Adam(1e-3))
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    paths = [v.path for v in model.optimizer.variables]
    assert len(set(paths)) == len(paths), paths
    for variable in models.half_weights(model):
        name = _name(variable)  # e.g. sequential_hidden_kernel
        assert f"loss_scale_optimizer/{name}" in paths, (name, paths)
        slot = f"/loss_scale_optimizer_{name}_momentum"  # adam/..., under the wrapper on TF
        assert any(p.endswith(slot) for p in paths), (slot, paths)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    # Named after the loaded model's own paths (Keras gives a loaded
    # Sequential's variables paths of its own), with the saved values.
    loaded_paths = [v.path for v in loaded.optimizer.variables]
    for variable in models.half_weights(loaded):
        assert f"loss_scale_optimizer/{_name(variable)}" in loaded_paths, loaded_paths
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(_numpy(restored), _numpy(saved), err_msg=saved.path)

    compensated = models.o3_classifier(keras.optimizers.Adam(1e-3), master_weights="compensated")
    compensated.optimizer.build(compensated.trainable_variables)
    names = {v.name for v in compensated.optimizer.variables}
    for variable in models.half_weights(compensated):
        assert _name(variable, "compensation") in names


@pytest.mark.perf
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's lowered program")
def test_the_master_copy_is_compared_with_a_rounding_xla_keeps():
    """A bfloat16 weight is its master copy's rounding: compared in float32
    on a GPU, where XLA drops a pair of converts around the copy (the half
    value then overwrote the master copy at every step); a reduce-precision
    it keeps."""
    import jax

    from keras_mp._src.optimizer.master_weights import reconciled

    copy = np.linspace(-2, 2, 8).astype("float32")
    text = jax.jit(reconciled).lower(copy, copy.astype(ml_dtypes.bfloat16)).as_text()
    assert "reduce_precision" in text
