"""keras-io's distributed-training guides' custom loops, as README writes
them, each in a fresh process (tests/optimizer/test_skipped_state.py runs them):

    KERAS_BACKEND=tensorflow python tests/custom_loop_worker.py tf_mirrored
    KERAS_BACKEND=jax python tests/custom_loop_worker.py jax_sharding
    KERAS_BACKEND=torch python tests/custom_loop_worker.py torch_ddp RANK PORT

- `tf_mirrored`: `guides/distributed_training_with_tensorflow.py`'s custom
  loop, `strategy.run` of a `GradientTape` step on two CPU replicas.
- `jax_sharding`: `guides/distributed_training_with_jax.py`, a `jax.jit`
  step with `stateless_apply`, the data split over 4 virtual CPU devices
  with `jax.sharding`, the state replicated.
- `torch_ddp`: `guides/distributed_training_with_torch.py`, one process per
  rank (gloo, 127.0.0.1), the model in `DistributedDataParallel`.

The guides' convnet (BatchNormalization, Dropout), trimmed to 8x8 digits,
forward passes with `training=True`, at one level per road (`LEVELS`). Step
`NAN_STEP` has a NaN in one replica's part of the batch only: the step must
be skipped everywhere, and everything a step changes (weights, the
optimizer's slots and `iterations`, and BatchNorm's moving statistics) must
be after it bit for bit what it was before; the next step trains, and
`predict` is finite. Exits non-zero with the assertion otherwise.
"""

import os
import sys

SCENARIO = sys.argv[1]
if SCENARIO.startswith("jax"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

if SCENARIO.startswith("tf"):
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    (_cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import keras_mp  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 4
NAN_STEP = 2
# One level per road, rotated: the skip is the same code at both (the
# single-device tests in test_skipped_state.py run both levels on every
# backend); what each road proves is its own distribution of the decision.
LEVELS = {
    "tf_mirrored": (("O2", "float16"),),
    "jax_sharding": (("O3", "bfloat16"),),
    "torch_ddp": (("O2", "float16"),),
}[SCENARIO]


def get_model():
    """The guides' convnet with BatchNormalization and Dropout, for 8x8 digits."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(filters=4, kernel_size=3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=8, kernel_size=3, use_bias=False, strides=2)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def get_data(nan_row):
    """`STEPS` global batches of digits; `nan_row` of step `NAN_STEP` is NaN."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[: STEPS * GLOBAL_BATCH] / 16.0).astype("float32")[..., None]
    y = digits.target[: STEPS * GLOBAL_BATCH].astype("int32")
    x[NAN_STEP * GLOBAL_BATCH + nan_row, 3, 3, 0] = np.nan
    return x, y


def amp_model_and_optimizer(level, dtype):
    """README's custom loop set-up: the level, then a LossScaleOptimizer."""
    model = get_model()
    keras_mp.apply_amp(model, level, dtype)
    float16 = dtype == "float16"
    optimizer = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic=float16, initial_scale=2.0**15 if float16 else 1.0
    )
    return model, optimizer


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).astype("float32")


def snapshot(model, optimizer):
    """Everything a step may change, but the loss-scale state."""
    own = {id(v) for v in optimizer._state_variables()}
    return {
        "trainable": [numpy(v) for v in model.trainable_variables],
        "non_trainable": [numpy(v) for v in model.non_trainable_variables],
        "optimizer": [numpy(v) for v in optimizer.variables if id(v) not in own],
    }


def assert_unchanged(before, after, what):
    for group in before:
        assert len(before[group]) == len(after[group])
        for i, (a, b) in enumerate(zip(before[group], after[group])):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: {group}[{i}] changed")


def check_the_skip(history, model, optimizer, level, dtype):
    """`history[i]`: the snapshot after step i (`history[-1]`: before step 0)."""
    assert_unchanged(history[NAN_STEP - 1], history[NAN_STEP], f"{level} {dtype} NaN step")
    assert int(numpy(optimizer.skipped_steps)) == 1
    assert int(numpy(optimizer.iterations)) == STEPS - 1
    scale = float(numpy(optimizer.loss_scale))
    assert scale == (2.0**14 if dtype == "float16" else 1.0), scale
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(history[NAN_STEP]["trainable"], history[NAN_STEP + 1]["trainable"])
    ]
    assert all(moved), moved  # the next step trains
    for group in ("trainable", "non_trainable"):
        assert all(np.isfinite(v).all() for v in history[STEPS - 1][group]), group


def check_predictions(model, x):
    y = numpy(model.predict(x[:GLOBAL_BATCH][~np.isnan(x[:GLOBAL_BATCH]).any(axis=(1, 2, 3))]))
    assert np.isfinite(y).all(), y


# -- TensorFlow: MirroredStrategy ----------------------------------------------


def tf_mirrored():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    x, y = get_data(nan_row=1)  # the first half: replica 0
    for level, dtype in LEVELS:
        with strategy.scope():
            model, optimizer = amp_model_and_optimizer(level, dtype)
            optimizer.build(model.trainable_variables)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

        @tf.function
        def train_step(x, y):
            with optimizer.restore_on_skip(model):  # a skipped step keeps BatchNorm's statistics
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True)) / GLOBAL_BATCH
                    scaled_loss = optimizer.scale_loss(loss)
                grads = tape.gradient(scaled_loss, model.trainable_variables)
                optimizer.apply(grads, model.trainable_variables)
            return loss

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        dataset = strategy.experimental_distribute_dataset(dataset.with_options(options))
        history = {-1: snapshot(model, optimizer)}
        for step, (xb, yb) in enumerate(dataset):
            strategy.run(train_step, args=(xb, yb))
            history[step] = snapshot(model, optimizer)
        check_the_skip(history, model, optimizer, level, dtype)
        # The replicas agree (BatchNorm's statistics are each replica's own).
        for variable in model.trainable_variables + list(optimizer.variables):
            copies = [numpy(c) for c in strategy.experimental_local_results(variable.value)]
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)
        check_predictions(model, x)
        print(f"tf_mirrored {level} {dtype}: ok")


# -- JAX: jax.sharding ------------------------------------------------------------


def jax_sharding():
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    num_devices = len(jax.local_devices())
    assert num_devices == 4, jax.local_devices()
    x, y = get_data(nan_row=1)  # the first quarter: device 0
    for level, dtype in LEVELS:
        model, optimizer = amp_model_and_optimizer(level, dtype)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.build((None, 8, 8, 1))
        optimizer.build(model.trainable_variables)

        def compute_loss(trainable_variables, non_trainable_variables, optimizer_variables, x, y):
            y_pred, updated_non_trainable_variables = model.stateless_call(
                trainable_variables, non_trainable_variables, x, training=True
            )
            loss_value = loss(y, y_pred)
            mapping = zip(optimizer.variables, optimizer_variables)
            with keras.StatelessScope(state_mapping=mapping):
                scaled_loss = optimizer.scale_loss(loss_value)
            return scaled_loss, (loss_value, updated_non_trainable_variables)

        compute_gradients = jax.grad(compute_loss, has_aux=True)

        @jax.jit
        def train_step(train_state, x, y):
            trainable_variables, non_trainable_variables, optimizer_variables = train_state
            grads, (loss_value, new_non_trainable_variables) = compute_gradients(
                trainable_variables, non_trainable_variables, optimizer_variables, x, y
            )
            trainable_variables, optimizer_variables, non_trainable_variables = (
                optimizer.stateless_apply(
                    optimizer_variables,
                    grads,
                    trainable_variables,
                    non_trainable_variables=(non_trainable_variables, new_non_trainable_variables),
                )
            )
            return loss_value, (trainable_variables, non_trainable_variables, optimizer_variables)

        devices = mesh_utils.create_device_mesh((num_devices,))
        var_replication = NamedSharding(Mesh(devices, axis_names=("_",)), P())
        data_sharding = NamedSharding(Mesh(devices, axis_names=("batch",)), P("batch"))
        train_state = tuple(
            jax.device_put([v.value for v in group], var_replication)
            for group in (model.trainable_variables, model.non_trainable_variables)
        ) + (jax.device_put([v.value for v in optimizer.variables], var_replication),)

        def write_back(train_state):
            groups = (model.trainable_variables, model.non_trainable_variables)
            for group, values in zip(groups + (optimizer.variables,), train_state):
                for variable, value in zip(group, values):
                    variable.assign(value)

        history = {-1: snapshot(model, optimizer)}
        for step in range(STEPS):
            rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
            sharded_x = jax.device_put(x[rows], data_sharding)
            _, train_state = train_step(train_state, sharded_x, y[rows])
            assert len(train_state[1][0].sharding.device_set) == num_devices
            write_back(train_state)
            history[step] = snapshot(model, optimizer)
        check_the_skip(history, model, optimizer, level, dtype)
        check_predictions(model, x)
        print(f"jax_sharding {level} {dtype}: ok")


# -- PyTorch: DistributedDataParallel, two processes -------------------------------


def torch_ddp():
    import hashlib
    import json

    import torch

    rank, port = int(sys.argv[2]), sys.argv[3]
    num_ranks = 2
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    torch.distributed.init_process_group(
        backend="gloo", init_method="env://", world_size=num_ranks, rank=rank
    )
    # DistributedSampler deals rows in turn: rank 0 takes the even ones.
    x, y = get_data(nan_row=2)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=num_ranks, rank=rank, shuffle=False
    )
    dataloader = torch.utils.data.DataLoader(
        dataset, sampler=sampler, batch_size=GLOBAL_BATCH // num_ranks, shuffle=False
    )
    for level, dtype in LEVELS:
        model, optimizer = amp_model_and_optimizer(level, dtype)
        model.build((None, 8, 8, 1))
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)

        def train_step(inputs, targets):
            with optimizer.restore_on_skip(model):  # a skipped step keeps BatchNorm's statistics
                loss = loss_fn(targets, ddp_model(inputs, training=True))
                model.zero_grad()
                optimizer.scale_loss(loss).backward()
                grads = [v.value.grad for v in model.trainable_variables]
                optimizer.apply(grads, model.trainable_variables)
            return loss

        history = {-1: snapshot(model, optimizer)}
        for step, (inputs, targets) in enumerate(dataloader):
            train_step(inputs, targets)
            history[step] = snapshot(model, optimizer)
        check_the_skip(history, model, optimizer, level, dtype)
        check_predictions(model, x)
        weights = b"".join(w.tobytes() for w in history[STEPS - 1]["trainable"])
        print(
            json.dumps(
                {
                    "level": f"{level} {dtype}",
                    "rank": rank,
                    "weights": hashlib.sha256(weights).hexdigest(),
                    "skipped_steps": int(numpy(optimizer.skipped_steps)),
                    "loss_scale": float(numpy(optimizer.loss_scale)),
                }
            )
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    globals()[SCENARIO]()
