"""Per-device memory of weights, master copies and optimizer slots (a
benchmark, not a test): does `shard_optimizer_state=True` (ZeRO-1) divide the
optimizer's state over the replicas?

A tiny KerasHub Gemma trained one step with Adam under
`keras.distribution.DataParallel` on 4 virtual CPU devices, at O0, Keras's
`mixed_bfloat16`, O2 and O3 in bfloat16, and O3 with the state sharded. The
bytes are read from the arrays' shards on each device (the most loaded
device's), not computed: what each device holds. Then the same arithmetic
for a 2B-parameter model with Adam on 8 devices.

    python benchmarks/optimizer_memory.py
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
DEVICES = 4
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
)

import _checkout  # noqa: E402,F401  (this checkout's keras_mp, not an installed one)
import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402,F401  (the amp keywords)

CONFIGS = {
    "O0": {"amp_level": "O0"},
    "Keras mixed_bfloat16": None,
    "O2 bfloat16": {"amp_level": "O2", "amp_dtype": "bfloat16"},
    "O3 bfloat16": {"amp_level": "O3", "amp_dtype": "bfloat16"},
    "O3 bfloat16, shard_optimizer_state=True": {
        "amp_level": "O3",
        "amp_dtype": "bfloat16",
        "shard_optimizer_state": True,
    },
    # Adam's moments in FP8 and float16 (MS-AMP's O2), alone and sharded.
    "O2 bfloat16, moment_dtypes='float8'": {
        "amp_level": "O2",
        "amp_dtype": "bfloat16",
        "moment_dtypes": "float8",
    },
    "O2 float8, moment_dtypes='float8', shard_optimizer_state=True": {
        "amp_level": "O2",
        "amp_dtype": "float8",
        "moment_dtypes": "float8",
        "shard_optimizer_state": True,
    },
}


def per_device(variables):
    """The most bytes the variables' shards take on one device."""
    totals = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values(), default=0)


def gemma(amp):
    keras.config.set_dtype_policy("mixed_bfloat16" if amp is None else "float32")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=1024,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=128,
        intermediate_dim=512,
        head_dim=32,
    )
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    keras.config.set_dtype_policy("float32")
    amp = dict(amp or {})
    optimizer = keras.optimizers.Adam(1e-3)
    moments = amp.pop("moment_dtypes", None)
    if moments:
        optimizer = keras_mp.LossScaleOptimizer(
            optimizer,
            dynamic=False,
            initial_scale=1.0,
            moment_dtypes=moments,
            shard_optimizer_state=amp.get("shard_optimizer_state", False),
        )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **amp,
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 1024, size=(8, 16)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids, dtype="bool")}
    model.fit(x, rng.integers(0, 1024, size=(8, 16)), batch_size=8, epochs=1, verbose=0)
    return model


def split(model):
    """(weights, master copies, slots) of a trained model."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    names = {v.path.replace("/", "_") for v in model.trainable_variables}
    copies = [v for v in optimizer.variables if v.name in names]
    slots = [v for v in inner.variables if len(v.shape)]
    return model.weights, copies, slots


def main():
    assert len(jax.devices()) == DEVICES, jax.devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    print(f"Per-device bytes, tiny Gemma, Adam, DataParallel on {DEVICES} devices:\n")
    print("| configuration | weights | master copies | slots | optimizer state | all |")
    print("|---|---|---|---|---|---|")
    parameters = None
    for name, amp in CONFIGS.items():
        model = gemma(amp)
        parameters = model.count_params()
        weights, copies, slots = (per_device(v) for v in split(model))
        kib = lambda b: f"{b / 1024:.0f} KiB"  # noqa: E731
        print(
            f"| {name} | {kib(weights)} | {kib(copies)} | {kib(slots)} | "
            f"{kib(copies + slots)} | {kib(weights + copies + slots)} |"
        )
    print(f"\n({parameters:,} parameters.)\n")
    print("The same arithmetic for a 2B-parameter model, Adam, 8 devices (GB a device):\n")
    print("| configuration | bytes a parameter | weights | master copies | slots | all |")
    print("|---|---|---|---|---|---|")
    params, devices = 2e9, 8
    for name, (weights, copies, slots) in {
        "O0": (4, 0, 8),
        "Keras mixed_bfloat16": (4, 0, 8),
        "O2 bfloat16": (4, 0, 8),
        "O3 bfloat16": (2, 4, 8),
        "O3 bfloat16, shard_optimizer_state=True": (2, 4 / devices, 8 / devices),
        "O2 bfloat16, moment_dtypes='float8'": (4, 0, 3),
        "O3 bfloat16, moment_dtypes='float8', shard_optimizer_state=True": (
            2,
            4 / devices,
            3 / devices,
        ),
    }.items():
        gb = lambda b: f"{b * params / 1e9:.1f}"  # noqa: E731
        total = weights + copies + slots
        print(f"| {name} | {total:g} | {gb(weights)} | {gb(copies)} | {gb(slots)} | {gb(total)} |")


if __name__ == "__main__":
    main()
