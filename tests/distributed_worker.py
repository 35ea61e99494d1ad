"""Distributed scenarios, run in processes of their own by tests/test_distributed.py.

Devices must be configured before the framework starts (two logical CPU
devices for TensorFlow, `--xla_force_host_platform_device_count=4` for JAX),
so scenarios run in a process of their own; those that share a device set-up
share one process (a comma-separated list), which pays the framework's import
and start-up once:

    KERAS_BACKEND=tensorflow python tests/distributed_worker.py tf_fit,tf_custom_loop
    KERAS_BACKEND=jax python tests/distributed_worker.py jax_data_parallel

Each scenario compares a run on several replicas against a single-device run
on the same global batches, in the same process, and prints `<scenario>: ok`
(or one line a case); the process exits non-zero, with each failing
scenario's traceback, when one fails (the others still run). The data puts a
NaN in the first part of one global batch: only replica 0 sees it, and the
step must be skipped everywhere.
"""

import functools
import os
import sys
import traceback

SCENARIOS = sys.argv[1].split(",")
if SCENARIOS == ["jax_two_processes"]:
    # One CPU device a process; the processes meet at a coordinator.
    os.environ["JAX_PLATFORMS"] = "cpu"
    PROCESS_ID, PORT = int(sys.argv[2]), sys.argv[3]
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=PROCESS_ID
    )
# Four CPU devices: keras.distribution's mesh of 2 x 2 (batch x model) for
# model parallelism, four replicas for data parallelism.
MESH_DEVICES = 4
if SCENARIOS[0].startswith("jax"):
    # On a machine with a GPU too.
    os.environ["JAX_PLATFORMS"] = "cpu"
    if SCENARIOS != ["jax_two_processes"]:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={MESH_DEVICES}"
        )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

if SCENARIOS[0].startswith("tf"):
    import tensorflow as tf

    # CPU replicas against a CPU reference, on a machine with a GPU too: the
    # single-device run would otherwise take the GPU (TF32 matmuls, XLA by
    # default) and differ from the replicas by more than rounding.
    tf.config.set_visible_devices([], "GPU")
    if "TF_CONFIG" not in os.environ:  # multi-worker: one device per worker
        (cpu,) = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )

import keras  # noqa: E402

import keras_mp  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 6
NAN_STEP = 2


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 6)).astype("float32")
    y = (x[:, :1] * 0.5 - x[:, 1:2]).astype("float32")
    x[NAN_STEP * GLOBAL_BATCH + 3, 2] = np.nan  # first half: replica 0 only
    return x, y


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )


def lso(master_weights=True):
    return keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9),
        initial_scale=2.0**8,
        dynamic_growth_steps=2,
        master_weights=master_weights,
    )


def compiled(amp_level, amp_dtype="float16", master_weights=True):
    model = build()
    model.compile(
        optimizer=lso(master_weights), loss="mse", amp_level=amp_level, amp_dtype=amp_dtype
    )
    return model


def single_device_state(**amp):
    """`state` of `compiled(**amp)` trained 2 epochs on one device (no
    distribution): the reference a distributed run is compared with, once
    a process for each set of arguments (the scenarios of one process share
    it)."""
    return _single_device_state(tuple(sorted(amp.items())))


@functools.lru_cache(maxsize=None)
def _single_device_state(amp):
    jax = keras.backend.backend() == "jax"
    if jax:  # one device: no keras.distribution while it trains
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
    x, y = data()
    single = compiled(**dict(amp))
    single.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    if jax:
        keras.distribution.set_distribution(distribution)
    return state(single)


# (name, compile arguments, tolerance against the single-device run)
LEVELS = (
    ("O0", {"amp_level": "O0"}, 1e-5),
    ("O2", {"amp_level": "O2"}, 2e-2),
    # float16 variables with float32 master weights.
    ("O3", {"amp_level": "O3"}, 2e-2),
    # bfloat16 variables with bfloat16 compensation buffers.
    (
        "O3-compensated",
        {"amp_level": "O3", "amp_dtype": "bfloat16", "master_weights": "compensated"},
        2e-2,
    ),
)


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def state(model, opt=None):
    opt = opt or model.optimizer
    return {
        "weights": [numpy(w) for w in model.weights],
        "loss_scale": float(numpy(opt.loss_scale)),
        "good_steps": int(numpy(opt.good_steps)),
        "skipped_steps": int(numpy(opt.skipped_steps)),
        "iterations": int(numpy(opt.iterations)),
    }


def assert_same(actual, expected, rtol):
    for key in ("loss_scale", "good_steps", "skipped_steps", "iterations"):
        assert actual[key] == expected[key], (key, actual[key], expected[key])
    for a, e in zip(actual["weights"], expected["weights"]):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol)


def assert_replicas_agree(strategy, model, opt=None):
    """Every replica holds the same loss-scale state and weights."""
    opt = opt or model.optimizer
    # The optimizer's variables: the state, master weights and slots.
    for variable in list(opt.variables) + model.weights:
        copies = [numpy(c) for c in strategy.experimental_local_results(variable.value)]
        assert len(copies) == strategy.num_replicas_in_sync == 2
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0], err_msg=variable.path)


# -- TensorFlow -----------------------------------------------------------------


def mirrored():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    return strategy


def tf_fit():
    """`model.fit` at each of `LEVELS` under MirroredStrategy."""
    x, y = data()
    for name, amp, rtol in LEVELS:
        expected = single_device_state(**amp)
        strategy = mirrored()
        with strategy.scope():
            model = compiled(**amp)
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        assert_replicas_agree(strategy, model)
        assert expected["skipped_steps"] == 2, expected  # the NaN batch, each epoch
        assert_same(state(model), expected, rtol)
        assert history.history["skipped_steps"] == [1.0, 2.0], history.history
        assert history.history["loss_scale"][-1] == expected["loss_scale"]
        print(f"tf_fit {name}: ok", state(model)["loss_scale"], expected["skipped_steps"])


def _custom_loop(strategy):
    """Trains with `scale_loss` + `apply`; on `strategy`, or on one device."""
    x, y = data()
    mse = keras.losses.MeanSquaredError(reduction=None)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = build()
        optimizer = lso()
        # Variables are created in the strategy's scope, before tracing.
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = mse(yb, model(xb, training=True))
            loss = tf.reduce_sum(per_example) / GLOBAL_BATCH
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    if strategy is None:
        step = tf.function(replica_step)
    else:
        step = tf.function(lambda xb, yb: strategy.run(replica_step, args=(xb, yb)))
        options = tf.data.Options()
        # Each replica takes its half of every global batch, in order.
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = strategy.experimental_distribute_dataset(dataset.with_options(options))
    for xb, yb in dataset:
        step(xb, yb)
    return model, optimizer


def tf_custom_loop():
    """`strategy.run` with `scale_loss` + `apply`, against one device."""
    strategy = mirrored()
    model, optimizer = _custom_loop(strategy)
    single, single_opt = _custom_loop(None)
    assert_replicas_agree(strategy, model, optimizer)
    expected = state(single, single_opt)
    assert expected["skipped_steps"] == 1
    assert_same(state(model, optimizer), expected, 1e-5)
    print("tf_custom_loop: ok")


def custom_replica_step(strategy, model):
    """A custom loop's replica step, its optimizer built in `strategy`'s scope."""
    with strategy.scope():
        optimizer = lso()
        optimizer.build(model.trainable_variables)

    def replica_step(xb):
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_mean(model(xb)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    return replica_step


def tf_jit_refused():
    """jit_compile=True across replicas: a clear error at compile time."""
    strategy = mirrored()
    with strategy.scope():
        model = build()
        try:
            model.compile(optimizer=lso(), loss="mse", amp_level="O2", jit_compile=True)
        except ValueError as e:
            message = str(e)
        else:
            raise AssertionError("compile(jit_compile=True) under MirroredStrategy was accepted")
    assert "jit_compile=False" in message and "21366" in message, message
    assert "Received: jit_compile=True with MirroredStrategy (2 replicas)" in message

    # A custom loop compiled with XLA gets the same message when traced.
    replica_step = custom_replica_step(strategy, model)

    step = tf.function(
        lambda xb: strategy.run(tf.function(replica_step, jit_compile=True), args=(xb,))
    )
    x, _ = data()
    try:
        step(tf.constant(x[:GLOBAL_BATCH]))
    except Exception as e:  # raised while tracing, wrapped by TensorFlow or not
        assert "jit_compile=False" in str(e), str(e)[-2000:]
    else:
        raise AssertionError("an XLA-compiled replica step was accepted")
    print("tf_jit_refused: ok")


def tf_save_and_reload_in_scope():
    """Save inside the strategy, reload inside it, train on: as one device."""
    import tempfile

    x, y = data()
    strategy = mirrored()
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    with strategy.scope():
        model = compiled("O2")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        model.save(path)
        loaded = keras.models.load_model(path)
    before = state(model)
    after = state(loaded)
    assert_same(after, before, 0)
    assert type(loaded.optimizer) is keras_mp.LossScaleOptimizer
    loaded.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    assert_replicas_agree(strategy, loaded)
    assert_same(state(loaded), single_device_state(amp_level="O2"), 2e-2)
    print("tf_save_and_reload_in_scope: ok")


def tf_multi_worker():
    """MultiWorkerMirroredStrategy: two worker processes on this machine.

    Without TF_CONFIG this launches the two workers (localhost ports) and
    checks that both finish with the same state; each worker compares itself
    against a single-device run on the same global batches.
    """
    if "TF_CONFIG" not in os.environ:
        _start_multi_worker()()
    else:
        _multi_worker_replica()


def _start_multi_worker():
    """Starts the two worker processes; returns the check that waits for them."""
    import json
    import socket
    import subprocess

    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            ports.append(sock.getsockname()[1])
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "tf_multi_worker"],
            env=dict(
                os.environ,
                TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]

    def finish():
        outputs = [w.communicate(timeout=300) for w in workers]
        for worker, (out, err) in zip(workers, outputs):
            assert worker.returncode == 0, err[-4000:]
        results = [line for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
        assert len(results) == 2 and results[0] == results[1], results
        print("tf_multi_worker: ok", results[0])

    return finish


def _multi_worker_replica():
    """One of the two workers (TF_CONFIG says which); prints its state as JSON."""
    import json

    # Keras 3.15's `fit` fails under MultiWorkerMirroredStrategy here with
    # or without keras_mp (PerReplica values reach `convert_to_tensor`): the
    # custom loop with `strategy.run` is what runs.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2
    model, optimizer = _custom_loop(strategy)
    single, single_opt = _custom_loop(None)
    expected = state(single, single_opt)
    assert expected["skipped_steps"] == 1
    assert_same(state(model, optimizer), expected, 1e-5)
    print(json.dumps({k: v for k, v in state(model, optimizer).items() if k != "weights"}))


# -- JAX ------------------------------------------------------------------------


def jax_data_parallel():
    """`keras.distribution.DataParallel` over four host devices."""
    import jax

    assert len(jax.devices()) == MESH_DEVICES, jax.devices()
    x, y = data()
    for name, amp, rtol in LEVELS:
        expected = single_device_state(**amp)
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
        model = compiled(**amp)
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        kernel = model.get_layer("hidden").kernel.value
        # Replicated on every device.
        assert len(kernel.sharding.device_set) == MESH_DEVICES
        assert expected["skipped_steps"] == 2
        assert_same(state(model), expected, rtol)
        assert history.history["skipped_steps"] == [1.0, 2.0], history.history
        print(f"jax_data_parallel {name}: ok")
    keras.distribution.set_distribution(None)


def jax_chunked_loss():
    """A language model's loss chunk by chunk under `DataParallel`: the
    tokens' shares of the loss follow the global batch (the batch is split
    over the replicas, the loss is not divided again); the same steps as
    the plain loss on the same devices."""
    import jax

    vocabulary, length = 61, 8
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (GLOBAL_BATCH, length)).astype("int32")
    labels = np.roll(ids, -1, axis=1)
    weight = np.ones((GLOBAL_BATCH, length), "float32")
    weight[::3, -3:] = 0.0  # padding
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    runs = {}
    for chunked_loss in (5, False):
        keras.utils.set_random_seed(3)
        tokens = keras.Input((length,), dtype="int32")
        hidden = keras.layers.Embedding(vocabulary, 8)(tokens)
        hidden = keras.layers.LayerNormalization()(hidden)
        model = keras.Model(tokens, keras.layers.Dense(vocabulary)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            amp_level="O2",
            amp_dtype="bfloat16",
            chunked_loss=chunked_loss,
        )
        losses = [
            model.train_on_batch(ids, labels, sample_weight=weight, return_dict=True)["loss"]
            for _ in range(2)
        ]
        runs[chunked_loss] = losses, model.get_weights(), keras_mp.precision_summary(model).loss
    keras.distribution.set_distribution(None)
    (chunked, chunked_weights, summary), (plain, plain_weights, _) = runs[5], runs[False]
    assert summary.startswith("float32 loss chunk by chunk"), summary
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-5)
    np.testing.assert_allclose(chunked[1], plain[1], rtol=2e-3)
    for a, b in zip(chunked_weights, plain_weights):
        np.testing.assert_allclose(a, b, atol=2e-3)
    print("jax_chunked_loss: ok")


# (name, compile arguments, tolerance against the single-device run)
# What a level changes in the optimizer's state: float32 variables with a
# dynamic scale (O2 float16), half variables with float32 master copies and
# a fixed scale (O3 bfloat16), and both (O3 float16). O1 differs from O2 by
# which layers compute in half only, the other bfloat16 cells by the dtype
# and the scale's absence only: nothing laid out differently (CI's time).
MESH_LEVELS = (
    ("O2-float16", {"amp_level": "O2"}, 2e-2),
    ("O3-float16", {"amp_level": "O3"}, 2e-2),
    ("O3-bfloat16", {"amp_level": "O3", "amp_dtype": "bfloat16"}, 5e-2),
)


def mesh_layout_map():
    """The MLP's kernels split over the "model" axis of a 2 x 2 mesh."""
    import jax

    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    layout_map[".*out/kernel"] = ("model", None)
    return layout_map


def spec(variable):
    """The axes a variable is split over, one per dimension."""
    axes = tuple(variable.value.sharding.spec)
    return axes + (None,) * (len(variable.shape) - len(axes))


def state_of(optimizer, variable):
    """The optimizer's variables kept for `variable`: its master copy (named
    after its path), the slots of the copy or of the variable itself."""
    name = variable.path.replace("/", "_")
    return [v for v in optimizer.variables if name in v.name and v.shape == variable.shape]


def assert_state_laid_out_like_its_variable(model, optimizer=None):
    optimizer = optimizer or model.optimizer
    for variable in model.trainable_variables:
        kept = state_of(optimizer, variable)
        assert kept, (variable.path, [v.path for v in optimizer.variables])
        for v in kept:
            assert spec(v) == spec(variable), (v.path, spec(v), variable.path, spec(variable))


def jax_model_parallel():
    """`keras.distribution.ModelParallel` with a `LayoutMap`, at every level:
    the same steps as on one device (the NaN batch skipped), master copies
    and slots laid out like their variables, and a `.keras` round trip under
    the distribution that predicts and resumes exactly."""
    import tempfile

    x, y = data()
    for name, amp, rtol in MESH_LEVELS:
        expected = single_device_state(**amp)
        distribution = keras.distribution.ModelParallel(
            layout_map=mesh_layout_map(), batch_dim_name="batch"
        )
        keras.distribution.set_distribution(distribution)
        model = compiled(**amp)
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        assert spec(model.get_layer("hidden").kernel) == (None, "model")
        assert history.history["skipped_steps"] == [1.0, 2.0], history.history
        assert_same(state(model), expected, rtol)
        assert_state_laid_out_like_its_variable(model)

        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        clean = np.nan_to_num(x[:GLOBAL_BATCH])
        np.testing.assert_array_equal(
            numpy(loaded.predict(clean, verbose=0)), numpy(model.predict(clean, verbose=0))
        )
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
            np.testing.assert_array_equal(numpy(a), numpy(b), err_msg=a.path)
            assert spec(a) == spec(b), (a.path, spec(a), spec(b))
        assert_state_laid_out_like_its_variable(loaded)
        # Training resumes exactly: the original goes on without a save.
        for m in (model, loaded):
            m.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        assert_same(state(loaded), state(model), 0.0)
        print(f"jax_model_parallel {name}: ok")
    keras.distribution.set_distribution(None)


def jax_model_parallel_gemma():
    """The zoo's tiny KerasHub Gemma under its own `get_layout_map`, at O3
    (two key/value heads, so that the "model" axis splits them)."""
    import jax
    import keras_hub

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.zoo import families

    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), jax.devices())
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    # O3: every variable's master copy and slots laid out as Gemma's map
    # lays the variable out (O2's slots: `jax_model_parallel`).
    for name, amp in (("O3-bfloat16", {"amp_level": "O3", "amp_dtype": "bfloat16"}),):
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
        keras.utils.set_random_seed(0)
        model, x, y, loss = families.gemma(num_key_value_heads=2)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, **amp)
        embeddings = model.backbone.get_layer("token_embedding").embeddings
        assert spec(embeddings) == ("model", "batch"), spec(embeddings)
        before = [numpy(v) for v in model.trainable_variables]
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        assert np.isfinite(history.history["loss"]).all(), history.history
        assert history.history["skipped_steps"][-1] == 0, history.history
        moved = [not np.array_equal(b, numpy(v)) for b, v in zip(before, model.trainable_variables)]
        assert all(moved), [v.path for v, m in zip(model.trainable_variables, moved) if not m]
        assert_state_laid_out_like_its_variable(model)
        print(f"jax_model_parallel_gemma {name}: ok")
    keras.distribution.set_distribution(None)


def state_bytes_per_device(optimizer):
    """The most bytes of optimizer state (master copies, slots) on one device;
    scalars (counters, the loss scale, moments' scales) are not split."""
    totals = {}
    for variable in optimizer.variables:
        if not variable.shape:
            continue
        for shard in variable.value.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values())


def jax_zero():
    """`shard_optimizer_state=True` (ZeRO-1) under `DataParallel` on 4 devices
    and `ModelParallel` on 2 x 2: the unsharded run's results, master copies
    and slots split over the batch axis, less optimizer memory per device, a
    `.keras` round trip that keeps the shards and resumes exactly; and a
    clear error without a distribution."""
    import tempfile

    import jax

    x, y = data()
    x = np.repeat(x, 2, axis=0)  # 8 rows a replica on 4 replicas
    y = np.repeat(y, 2, axis=0)
    batch = 2 * GLOBAL_BATCH
    distributions = {
        "DataParallel": lambda: keras.distribution.DataParallel(devices=jax.devices()),
        "ModelParallel": lambda: keras.distribution.ModelParallel(
            layout_map=mesh_layout_map(), batch_dim_name="batch"
        ),
    }
    # Each level once: the plain split over 4 replicas, and beside the
    # "model" axis O3's master copies and FP8 moments (MS-AMP's O2).
    cells = {
        "DataParallel": (("O2-float16", {"amp_level": "O2"}),),
        "ModelParallel": (
            ("O3-bfloat16", {"amp_level": "O3", "amp_dtype": "bfloat16"}),
            ("O2-bfloat16-float8-moments", {"amp_level": "O2", "amp_dtype": "bfloat16"}),
        ),
    }
    for where, make in distributions.items():
        for name, amp in cells[where]:
            runs = {}
            for shard in (False, True):
                keras.distribution.set_distribution(make())
                model = build()
                optimizer = keras.optimizers.Adam(1e-2)
                if "moments" in name:
                    optimizer = keras_mp.LossScaleOptimizer(
                        optimizer,
                        dynamic=False,
                        initial_scale=1.0,
                        moment_dtypes="float8",
                        shard_optimizer_state=shard,
                    )
                model.compile(
                    optimizer=optimizer,
                    loss="mse",
                    shard_optimizer_state=shard,
                    **amp,
                )
                model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
                runs[shard] = model
            sharded, plain = runs[True], runs[False]
            assert sharded.optimizer.shard_optimizer_state
            assert_same(state(sharded), state(plain), 1e-5)
            replicas = 4 if where == "DataParallel" else 2
            for variable in sharded.trainable_variables:
                # Split where a dimension not split yet divides by the replicas.
                free = [
                    n % replicas == 0 and a is None for n, a in zip(variable.shape, spec(variable))
                ]
                for v in state_of(sharded.optimizer, variable):
                    assert ("batch" in spec(v)) == any(free), (v.path, spec(v))
                assert "batch" not in spec(variable), (variable.path, spec(variable))
            less = state_bytes_per_device(sharded.optimizer)
            more = state_bytes_per_device(plain.optimizer)
            assert less < 0.6 * more, (less, more)

            path = os.path.join(tempfile.mkdtemp(), "model.keras")
            sharded.save(path)
            loaded = keras.models.load_model(path)
            assert loaded.optimizer.shard_optimizer_state
            for m in (sharded, loaded):
                m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            assert_same(state(loaded), state(sharded), 0.0)
            for a, b in zip(sharded.optimizer.variables, loaded.optimizer.variables):
                assert spec(a) == spec(b), (a.path, spec(a), spec(b))
            print(f"jax_zero {where} {name}: ok ({less} of {more} bytes a device)")

    keras.distribution.set_distribution(None)
    model = build()
    model.compile(optimizer="adam", loss="mse", amp_level="O2", shard_optimizer_state=True)
    try:
        model.fit(np.nan_to_num(x), y, batch_size=batch, epochs=1, verbose=0)
    except ValueError as error:
        assert "keras.distribution.set_distribution" in str(error), str(error)
    else:
        raise AssertionError("shard_optimizer_state=True trained without a distribution")
    print("jax_zero without a distribution: ok (refused)")


def jax_two_processes():
    """Two JAX processes (`jax.distributed`, CPU collectives over gloo), one
    device each, under `DataParallel`: each feeds its half of every global
    batch, and only process 0's half of one batch has a NaN. Both must make
    one skip decision per step and keep identical weights, those of one
    device trained on the global batches. Prints the state as JSON."""
    import hashlib
    import json

    import jax

    assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
    x, y = data()
    half = GLOBAL_BATCH // 2
    rows = np.concatenate(
        [
            np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)[
                PROCESS_ID * half : (PROCESS_ID + 1) * half
            ]
            for step in range(STEPS)
        ]
    )
    for name, amp, rtol in LEVELS[1:3]:  # O2 and O3 in float16
        expected = single_device_state(**amp)
        # Each process feeds its own half: the data is sharded already.
        distribution = keras.distribution.DataParallel(
            devices=jax.devices(), auto_shard_dataset=False
        )
        keras.distribution.set_distribution(distribution)
        model = compiled(**amp)
        model.fit(x[rows], y[rows], batch_size=half, epochs=2, shuffle=False, verbose=0)
        ours = state(model)
        assert_same(ours, expected, rtol)
        digest = hashlib.sha256(b"".join(w.tobytes() for w in ours["weights"])).hexdigest()
        summary = {k: v for k, v in ours.items() if k != "weights"}
        print(json.dumps({"level": name, "process": PROCESS_ID, "weights": digest, **summary}))
    keras.distribution.set_distribution(None)


def tf_central_storage_refused():
    """CentralStorageStrategy with two replicas: a clear refusal, at compile
    time and in a custom loop; Keras's plain optimizer still trains there."""
    strategy = tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0"
    )
    x, y = data()
    x = np.nan_to_num(x)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)  # the baseline works
    for how in ("compile", "amp_level"):
        with strategy.scope():
            model = build()
            try:
                if how == "compile":
                    model.compile(optimizer=lso(), loss="mse")
                else:
                    model.compile(optimizer="sgd", loss="mse", amp_level="O2")
            except ValueError as e:
                message = str(e)
            else:
                raise AssertionError(f"CentralStorageStrategy accepted ({how})")
        assert "CentralStorageStrategy" in message and "MirroredStrategy" in message, message
        assert "Received: CentralStorageStrategy with 2 replicas" in message, message

    replica_step = custom_replica_step(strategy, model)

    try:
        tf.function(lambda xb: strategy.run(replica_step, args=(xb,)))(
            tf.constant(x[:GLOBAL_BATCH])
        )
    except Exception as e:
        assert "does not support tf.distribute.experimental.CentralStorageStrategy" in str(e), str(
            e
        )[-2000:]
    else:
        raise AssertionError("a custom loop under CentralStorageStrategy was accepted")
    print("tf_central_storage_refused: ok")


def main(names):
    """Runs each scenario of `names` in turn; exits non-zero if one failed.

    The two processes of `tf_multi_worker` start first: they import
    TensorFlow and meet while this process runs the other scenarios.
    """
    if "tf_multi_worker" in names and "TF_CONFIG" not in os.environ:
        finish_multi_worker = _start_multi_worker()
    failed = []
    for name in names:
        if name == "tf_multi_worker" and "TF_CONFIG" not in os.environ:
            scenario = finish_multi_worker
        else:
            scenario = globals()[name]
        try:
            scenario()
        except Exception:
            traceback.print_exc()
            print(f"{name}: FAILED", flush=True)
            failed.append(name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main(SCENARIOS)
