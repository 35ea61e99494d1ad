"""Training speed of each precision level (a benchmark, not a test).

Per backend (one process each with --all), in one process, alternating the
configurations round by round, median over rounds: steps/s of

- O0, and O1/O2/O3 in float16 and bfloat16 (`compile(amp_level=...)`),
- Keras's own global `mixed_float16` / `mixed_bfloat16` policy on the same
  model (with Keras's LossScaleOptimizer for float16),
- O2 float16 without keras_mp's BatchNorm guard (the same policies and
  optimizer, compiled plainly): the guard's cost per step,
- O2 bfloat16 unchecked (`loss_scale=None`): the cost of checking each
  bfloat16 step and skipping a non-finite one (the default),

on an MLP, a small CNN with BatchNorm and a transformer block (the
default: sized for a CPU), or on the same shapes made large enough that a
GPU's matrix units, not its kernel launches, set the pace (`--models
mlp_large transformer_large`, for a GPU only: minutes a step on a CPU).

    python benchmarks/amp_levels.py --all
    KERAS_BACKEND=torch python benchmarks/amp_levels.py --models cnn_bn
"""

import argparse
import functools
import os
import statistics
import subprocess
import sys

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from _common import JIT_COMPILE
from _common import built_for
from lso_overhead import _calibrated_steps
from lso_overhead import _steady_state_timer

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("mlp", "cnn_bn", "transformer")
GPU_MODELS = ("mlp_large", "transformer_large", "cnn_large")
CONFIGS = (
    "O0",
    "O1 float16",
    "O2 float16",
    "O3 float16",
    "O1 bfloat16",
    "O2 bfloat16",
    "O3 bfloat16",
    "keras mixed_float16",
    "keras mixed_bfloat16",
    "O2 float16 no guard",
    "O2 bfloat16 unchecked",
)


def _build(keras, name):
    layers = keras.layers
    if name in ("mlp", "mlp_large"):
        # The large one's input stays narrow: a batch copied from the host
        # must not set the pace.
        width, features = (512, 512) if name == "mlp" else (4096, 64)
        return keras.Sequential(
            [
                keras.Input((features,)),
                layers.Dense(width, activation="relu"),
                layers.Dense(width, activation="relu"),
                layers.Dense(10, activation="softmax"),
            ]
        ), (features,)
    if name == "cnn_large":
        # keras.applications' ResNet50, random weights (nothing downloaded).
        shape = (128, 128, 3)
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=10), shape
    if name == "cnn_bn":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, padding="same"),
                layers.BatchNormalization(),
                layers.ReLU(),
                layers.MaxPooling2D(),
                layers.Conv2D(64, 3, padding="same"),
                layers.BatchNormalization(),
                layers.ReLU(),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10, activation="softmax"),
            ]
        ), (32, 32, 3)
    # One pre-norm transformer block: (tokens, features, width, heads).
    tokens, features, width, heads = (32, 64, 64, 4) if name == "transformer" else (256, 16, 512, 8)
    inputs = keras.Input((tokens, features))
    x = inputs if features == width else layers.Dense(width)(inputs)
    h = layers.LayerNormalization()(x)
    h = x + layers.MultiHeadAttention(heads, width // heads)(h, h)
    f = layers.LayerNormalization()(h)
    f = layers.Dense(4 * width, activation="gelu")(f)
    h = h + layers.Dense(width)(f)
    outputs = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs), (tokens, features)


def _compiled(keras, keras_mp, model_name, config, jit_compile="auto"):
    model, shape = built_for(keras, config, lambda: _build(keras, model_name))
    optimizer = keras.optimizers.Adam(1e-3)
    loss = "sparse_categorical_crossentropy"
    compile = functools.partial(keras.Model.compile, jit_compile=jit_compile)
    if config.startswith("keras "):
        compile(model, optimizer=optimizer, loss=loss)  # Keras wraps float16 itself
        return model, shape
    if config == "O0":
        compile(model, optimizer=optimizer, loss=loss, amp_level="O0")
    elif config.endswith("no guard"):
        keras_mp.apply_amp(model, "O2", "float16")
        compile(model, optimizer=keras_mp.LossScaleOptimizer(optimizer), loss=loss)
    elif config.endswith("unchecked"):
        level, dtype, _ = config.split()
        compile(
            model, optimizer=optimizer, loss=loss, amp_level=level, amp_dtype=dtype, loss_scale=None
        )
    else:
        level, dtype = config.split()
        compile(model, optimizer=optimizer, loss=loss, amp_level=level, amp_dtype=dtype)
    return model, shape


def run_one_backend(rounds, batch, model_names, configs=CONFIGS, jit_compile="auto"):
    import keras
    import numpy as np

    import keras_mp

    rng = np.random.default_rng(0)
    rows = []
    for model_name in model_names:
        models, data, unsupported = {}, {}, {}
        for config in configs:
            model, shape = _compiled(keras, keras_mp, model_name, config, jit_compile)
            try:
                steps = _calibrated_steps(keras, model, shape, batch, 40, rng, budget_s=0.3)
            except Exception as e:  # e.g. float16 attention on JAX's CPU backend
                unsupported[config] = str(e).splitlines()[0][:90]
                continue
            x = rng.normal(size=(steps * batch,) + shape).astype("float32")
            y = rng.integers(0, 10, size=(steps * batch,))
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
            models[config], data[config] = model, (x, y)
        timer = _steady_state_timer(keras)(skip=2)
        runnable = tuple(c for c in configs if c in models)
        times = {c: [] for c in runnable}
        for r in range(rounds):
            for config in runnable if r % 2 == 0 else runnable[::-1]:
                x, y = data[config]
                models[config].fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[timer])
                times[config].append(timer.per_step)
        median = {c: statistics.median(t) for c, t in times.items()}
        for config in configs:
            if config in unsupported:
                rows.append(
                    (keras.backend.backend(), model_name, config, None, unsupported[config])
                )
                continue
            rows.append(
                (
                    keras.backend.backend(),
                    model_name,
                    config,
                    1.0 / median[config],
                    median["O0"] / median[config],
                )
            )

        def ratio(a, b):
            return f"{median[a] / median[b]:.3f}" if a in median and b in median else "n/a"

        print(
            f"# {keras.backend.backend()} {model_name}: O2/Keras mixed step time "
            f"float16 {ratio('O2 float16', 'keras mixed_float16')}, "
            f"bfloat16 {ratio('O2 bfloat16', 'keras mixed_bfloat16')}; "
            f"BatchNorm guard {ratio('O2 float16', 'O2 float16 no guard')}; "
            f"bfloat16 check {ratio('O2 bfloat16', 'O2 bfloat16 unchecked')}",
            flush=True,
        )
    return rows


HEADER = "| backend | model | configuration | steps/s | speed-up over O0 |\n|---|---|---|---|---|"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true")
    parser.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        choices=BACKENDS,
        help="with --all: which backends",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + GPU_MODELS)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=CONFIGS,
        metavar="CONFIG",
        help="a subset of: " + ", ".join(repr(c) for c in CONFIGS) + " (O0 is always run)",
    )
    parser.add_argument(
        "--jit-compile",
        default="auto",
        choices=list(JIT_COMPILE),
        help="`compile(jit_compile=...)`: XLA on or off (TensorFlow: compare both)",
    )
    args = parser.parse_args()
    jit_compile = JIT_COMPILE[args.jit_compile]
    if args.all:
        print(HEADER)
        for backend in args.backends:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--rounds",
                    str(args.rounds),
                    "--batch",
                    str(args.batch),
                    "--models",
                    *args.models,
                    "--configs",
                    *args.configs,
                    "--jit-compile",
                    args.jit_compile,
                ],
                env=dict(os.environ, KERAS_BACKEND=backend),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            print(
                "\n".join(ln for ln in out.splitlines() if ln.startswith((f"| {backend}", "#"))),
                flush=True,
            )
        return
    print(HEADER)
    configs = tuple(c for c in CONFIGS if c == "O0" or c in args.configs)
    for r in run_one_backend(args.rounds, args.batch, args.models, configs, jit_compile):
        if r[3] is None:
            print(f"| {r[0]} | {r[1]} | {r[2]} | unsupported | {r[4]} |", flush=True)
        else:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
