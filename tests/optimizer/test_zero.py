"""ZeRO stage 1 (`zero.py`): where sharding the optimizer's state applies and
where it is refused by name. The sharded runs themselves need several
devices: `test_distributed.py::test_jax_zero_shards_the_optimizer_state_over_the_replicas`
(4 virtual CPU devices, a process of its own)."""

import keras
import pytest

import keras_mp
from keras_mp._src.optimizer import zero

BACKEND = keras.backend.backend()


def test_a_bad_value_is_named():
    with pytest.raises(TypeError, match="shard_optimizer_state=1"):
        keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), shard_optimizer_state=1)


@pytest.mark.skipif(BACKEND == "jax", reason="JAX has keras.distribution")
def test_backends_without_keras_distribution_refuse_it_by_name():
    for make in (
        lambda: keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), shard_optimizer_state=True),
        lambda: keras.Sequential([keras.layers.Dense(1)]).compile(
            optimizer="adam", loss="mse", amp_level="O3", shard_optimizer_state=True
        ),
    ):
        with pytest.raises(ValueError) as info:
            make()
        assert f"shard_optimizer_state=True on the {BACKEND} backend" in str(info.value)


def test_it_needs_amp_level_or_a_loss_scale_optimizer():
    with pytest.raises(ValueError, match="need `amp_level`"):
        keras.Sequential([keras.layers.Dense(1)]).compile(
            optimizer="adam", loss="mse", shard_optimizer_state=True
        )


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_without_a_distribution_the_build_says_what_to_set():
    keras.distribution.set_distribution(None)
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), shard_optimizer_state=True)
    with pytest.raises(ValueError, match="keras.distribution.set_distribution"):
        optimizer.build([keras.Variable([1.0, 2.0])])


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_the_layout_splits_the_first_free_dimension_the_replicas_divide():
    import jax

    devices = jax.devices()[:1]  # one device: a mesh of 1 x 1 still names its axes
    mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    distribution = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )
    with distribution.scope():
        kernel = keras.Variable(keras.ops.zeros((6, 4)))
        scalar = keras.Variable(0.0)
    assert zero.sharded_layout(kernel, distribution).axes == ("batch", None)
    assert tuple(zero.sharded_layout(scalar, distribution).axes) == ()


def test_the_setting_is_saved_with_the_optimizer():
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    assert optimizer.shard_optimizer_state is False
    config = optimizer.get_config()
    assert config["shard_optimizer_state"] is False
    assert keras_mp.LossScaleOptimizer.from_config(config).shard_optimizer_state is False


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution on JAX")
def test_compile_and_an_explicit_optimizer_must_agree():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    with pytest.raises(ValueError, match="shard_optimizer_state=True, optimizer.shard_optimizer"):
        model.compile(optimizer=optimizer, loss="mse", amp_level="O2", shard_optimizer_state=True)
    sharded = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(), shard_optimizer_state=True)
    model.compile(optimizer=sharded, loss="mse", amp_level="O2")
    assert model.optimizer is sharded
    bare = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    bare.compile(optimizer="adam", loss="mse", amp_level="O0", shard_optimizer_state=True)
    assert bare.optimizer.shard_optimizer_state  # wrapped for it, even at O0
