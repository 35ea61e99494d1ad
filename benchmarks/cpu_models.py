"""The models users train on a CPU: does bfloat16 pay on this processor?

A KerasHub BERT classifier and a GPT-2 language model (hidden 512, 4
layers, 8 heads, 128 tokens, vocabulary 8192, batch 16),
keras.applications' ResNet50 at 96x96 (batch 16, 10 classes), and the
main job's digits MLP (64 -> 256 -> BatchNorm -> 256 -> 10, batch 32: a
step its launches dominate, timed `MLP_STEPS` times more steps a round),
built from configs with random weights (nothing downloaded). Per backend, in one
process, `train_on_batch` steps of O0, O2 bfloat16, O3 bfloat16 and Keras's
own `mixed_bfloat16` policy, the configurations alternated round by round,
medians over rounds; beside them this CPU's flags and the matmul rates
`amp_level="auto"` measures (`keras_mp._src.backends.cpu_rates`), what
`auto` picks for the model, and `speed_report(device="cpu")`'s bound and
predicted speed-up for O2 (`predicted_speedup`: the step's matmuls,
other work, casts and launches at this CPU's measured costs, what `auto`
decides from).

A configuration whose bfloat16 matmul measured under a tenth of float32's
rate (PyTorch emulates bfloat16 at about 1 GFLOP/s on a CPU without
AVX512-BF16) is not timed: a step would take minutes.

    python benchmarks/cpu_models.py --all
    KERAS_BACKEND=jax python benchmarks/cpu_models.py --models bert --rounds 5
"""

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from _common import built_for
from _common import level_of

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("bert", "gpt2", "resnet50", "mlp")
MLP_STEPS = 50
CONFIGS = ("O0", "O2 bfloat16", "O3 bfloat16", "keras mixed_bfloat16")
BATCH = 16
TOKENS = 128
VOCABULARY = 8192
HEADER = (
    "| backend | model | O0 ms | O2 bfloat16 | O3 bfloat16 | Keras mixed_bfloat16 "
    "| report's bound (O2) | predicted (O2) | matmul GFLOP/s (float32 / bfloat16) "
    "| memory GB/s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _build(keras, name):
    """The model, its loss, and one batch (x, y)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":
        layers = keras.layers
        model = keras.Sequential(
            [
                keras.Input((64,)),
                layers.Dense(256, activation="relu"),
                layers.BatchNormalization(),
                layers.Dense(256, activation="relu"),
                layers.Dense(10, activation="softmax"),
            ]
        )
        x = rng.random((32, 64)).astype("float32")
        return model, "sparse_categorical_crossentropy", (x, rng.integers(0, 10, size=32))
    if name == "resnet50":
        shape = (96, 96, 3)
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=10)
        x = rng.normal(size=(BATCH,) + shape).astype("float32")
        return model, "sparse_categorical_crossentropy", (x, rng.integers(0, 10, size=BATCH))
    import keras_hub

    size = dict(
        vocabulary_size=VOCABULARY,
        num_layers=4,
        num_heads=8,
        hidden_dim=512,
        intermediate_dim=2048,
        max_sequence_length=TOKENS,
    )
    ids = rng.integers(0, VOCABULARY, size=(BATCH, TOKENS + 1)).astype("int32")
    mask = np.ones((BATCH, TOKENS), "int32")
    if name == "bert":
        backbone = keras_hub.models.BertBackbone(**size)
        model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
        x = {"token_ids": ids[:, :-1], "segment_ids": 0 * mask, "padding_mask": mask}
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, loss, (x, rng.integers(0, 2, size=BATCH))
    backbone = keras_hub.models.GPT2Backbone(**size)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, (x, ids[:, 1:])


def _compiled(keras, name, config):
    model, loss, batch = built_for(keras, config, lambda: _build(keras, name))
    optimizer = keras.optimizers.Adam(1e-4)
    if config.startswith("keras "):
        model.compile(optimizer=optimizer, loss=loss)
    else:
        level, dtype = level_of(config)
        model.compile(optimizer=optimizer, loss=loss, amp_level=level, amp_dtype=dtype)
    return model, batch


def run(name, rounds, steps):
    import keras

    import keras_mp
    from keras_mp._src.backends import cpu_rates
    from keras_mp._src.precision import amp_settings
    from keras_mp._src.precision import auto_level

    backend = keras.backend.backend()
    rates = {d: cpu_rates.matmul_rate(d) for d in ("float32", "bfloat16")}
    emulated = rates["bfloat16"] < 0.1 * rates["float32"]
    configs = [c for c in CONFIGS if c == "O0" or not emulated]
    models = {}
    for config in configs:
        model, batch = _compiled(keras, name, config)
        model.train_on_batch(*batch)  # compiles the step
        models[config] = model
    times = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            model = models[config]
            start = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(*batch)
            times[config].append((time.perf_counter() - start) / steps)
    median = {c: statistics.median(t) for c, t in times.items()}
    model, loss, batch = _build(keras, name)
    summary = keras_mp.speed_report(model, batch[0], "O2", "bfloat16", device="cpu").summary
    predicted = summary["predicted_speedup"]

    def cell(config):
        if config not in median:
            return f"n/a: bfloat16 matmul {rates['bfloat16'] / 1e9:.1f} GFLOP/s"
        return f"{median['O0'] / median[config]:.2f}x"

    print(
        f"| {backend} | {name} | {median['O0'] * 1e3:.0f} | {cell('O2 bfloat16')} "
        f"| {cell('O3 bfloat16')} | {cell('keras mixed_bfloat16')} "
        f"| {summary['speedup_bound_tf32']:.2f} | {predicted:.2f}x "
        f"| {rates['float32'] / 1e9:.0f} / {rates['bfloat16'] / 1e9:.0f} "
        f"| {cpu_rates.memory_bandwidth() / 1e9:.1f} |",
        flush=True,
    )

    def settings_for(level, half):
        return dataclasses.replace(amp_settings.for_layers(level, half), loss=loss)

    level, dtype, reason = auto_level.pick_auto_level(None, model, settings_for)
    picked = level if level == "O0" else f"{level} {dtype}"  # O0: no half dtype
    print(f"# {backend} {name}: auto picks {picked}: {reason}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every backend, one process each")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    args = parser.parse_args()
    if min(args.rounds, args.steps) < 1:
        parser.error("--rounds and --steps must be positive")
    if args.all:
        from keras_mp._src.backends import cpu_rates

        flags = " ".join(
            sorted(
                cpu_rates.cpu_flags()
                & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}
            )
        )
        print(f"# {cpu_rates.cpu_name()}, {os.cpu_count()} cores; flags: {flags}")
        print(HEADER, flush=True)
        for backend in BACKENDS:
            out = subprocess.run(
                [sys.executable, __file__, "--models", *args.models,
                 "--rounds", str(args.rounds), "--steps", str(args.steps)],
                env={**os.environ, "KERAS_BACKEND": backend},
                capture_output=True, text=True,
            )  # fmt: skip
            print("\n".join(ln for ln in out.stdout.splitlines() if ln.startswith(("|", "#"))))
            if out.returncode:
                print(f"# {backend}: exit {out.returncode}: {out.stderr[-500:]}", flush=True)
        return
    import keras

    keras.config.disable_interactive_logging()
    for name in args.models:
        run(name, args.rounds, args.steps * (MLP_STEPS if name == "mlp" else 1))


if __name__ == "__main__":
    main()
