"""Step-time overhead of loss scaling (a benchmark, not a test).

For one backend per process (set KERAS_BACKEND, or pass --all to run each
backend in its own subprocess), compares in one process, alternating the
variants round by round; each ratio is the median over rounds of the ratio
of two epochs timed in the same round (the last column: the ratio of the
means of each variant's fastest tenth of epochs, the steadier estimate on a
shared machine):

- plain:  the inner optimizer alone (no loss scaling),
- keras:  Keras's built-in `keras.optimizers.LossScaleOptimizer`,
- keras_mp: `keras_mp.LossScaleOptimizer` (dynamic), with keras_mp's train
  step and `fit` (at `verbose=0` its telemetry is read once an epoch),
- keras_mp_no_logs: the same optimizer in Keras's own train step and `fit`
  (the cost of keras_mp's step around the optimizer, side by side),

on a 3-layer MLP (256 wide, batch 64) and a small CNN, in float32 and in
mixed_float16. Each timing is one `fit` epoch of `--steps` steps.

    python benchmarks/lso_overhead.py --all
    KERAS_BACKEND=jax python benchmarks/lso_overhead.py --rounds 15
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from _common import JIT_COMPILE
from _common import fastest_decile
from _common import without_telemetry

BACKENDS = ("tensorflow", "jax", "torch")
TIMER_SKIP = 3  # steps of each epoch left out of its timing
MIN_STEPS = 8
VARIANTS = ("plain", "keras", "keras_mp", "keras_mp_no_logs")
POLICIES = ("float32", "mixed_float16")
MODELS = ("mlp", "cnn")


def _models(keras):
    def mlp():
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )

    def cnn():
        return keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
                keras.layers.Activation("softmax", dtype="float32"),
            ]
        )

    return {"mlp": (mlp, (784,)), "cnn": (cnn, (28, 28, 1))}


def _steady_state_timer(keras):
    class SteadyStateTimer(keras.callbacks.Callback):
        """Seconds per step after the first `skip` steps of an epoch.

        The clock stops at `on_epoch_end`, where Keras reads the logs and so
        waits for the device: asynchronous dispatch (JAX) is counted in full,
        and `fit`'s own set-up is not counted at all.
        """

        def __init__(self, skip):
            super().__init__()
            self.skip = skip

        def on_train_batch_begin(self, batch, logs=None):
            if batch == self.skip:
                self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.per_step = (time.perf_counter() - self._start) / (self.params["steps"] - self.skip)

    return SteadyStateTimer


def run_one_backend(
    rounds, steps, batch, policies=POLICIES, model_names=MODELS, jit_compile="auto"
):
    import keras
    import numpy as np

    import keras_mp

    results = []
    rng = np.random.default_rng(0)
    for policy in policies:
        for model_name, (build, shape) in _models(keras).items():
            if model_name not in model_names:
                continue
            models = {}
            x = y = None
            for variant in VARIANTS:
                keras.config.set_dtype_policy(policy)
                keras.utils.set_random_seed(0)
                model = build()
                inner = keras.optimizers.Adam(1e-3)
                if variant == "plain":
                    optimizer = inner
                elif variant == "keras":
                    optimizer = keras.optimizers.LossScaleOptimizer(inner)
                else:
                    optimizer = keras_mp.LossScaleOptimizer(inner)
                model.compile(
                    optimizer=optimizer,
                    loss="sparse_categorical_crossentropy",
                    auto_scale_loss=False,
                    jit_compile=jit_compile,
                )
                if variant == "keras_mp_no_logs":
                    without_telemetry(model)
                if x is None:
                    # Size the epoch to the configuration's speed: float16 on
                    # a CPU without half kernels is two orders slower.
                    n = _calibrated_steps(keras, model, shape, batch, steps, rng)
                    x = rng.normal(size=(n * batch,) + shape).astype("float32")
                    y = rng.integers(0, 10, size=(n * batch,))
                # Warm up: trace/compile and the first epochs.
                model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
                models[variant] = model
            timer = _steady_state_timer(keras)(skip=TIMER_SKIP)
            times = {v: [] for v in VARIANTS}
            for r in range(rounds):
                order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    models[variant].fit(
                        x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[timer]
                    )
                    times[variant].append(timer.per_step)

            def ratio(a, b, times=times):
                return _paired_median(times[a], times[b])

            results.append(
                (
                    keras.backend.backend()
                    + (
                        " (XLA)"
                        if models["plain"].jit_compile and keras.backend.backend() == "tensorflow"
                        else ""
                    ),
                    model_name,
                    policy,
                    statistics.median(times["plain"]) * 1e3,
                    ratio("keras", "plain"),
                    ratio("keras_mp", "plain"),
                    ratio("keras_mp", "keras"),
                    ratio("keras_mp", "keras_mp_no_logs"),
                    fastest_decile(times["keras"]) / fastest_decile(times["plain"]),
                    fastest_decile(times["keras_mp"]) / fastest_decile(times["plain"]),
                )
            )
            keras.config.set_dtype_policy("float32")
    return results


def _paired_median(times_a, times_b):
    """Median over rounds of the ratio a/b, both timed in the same round.

    The machine's speed drifts between rounds (a shared 2-core VM moves by
    about 10 % from one epoch to the next); a ratio of two epochs timed side
    by side cancels the drift, and the median of those ratios ignores the
    rounds that a neighbour disturbed.
    """
    return statistics.median(a / b for a, b in zip(times_a, times_b))


def _calibrated_steps(keras, model, shape, batch, steps, rng, budget_s=0.4):
    x = rng.normal(size=(4 * batch,) + shape).astype("float32")
    y = rng.integers(0, 10, size=(4 * batch,))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    per_step = (time.perf_counter() - start) / 4
    return int(min(steps, max(MIN_STEPS, budget_s / per_step)))


HEADER = (
    "| backend | model | policy | plain step (ms) | Keras LSO / plain "
    "| keras_mp / plain | keras_mp / Keras LSO | keras_mp's step (with / without) "
    "| fastest decile: Keras LSO / plain, keras_mp / plain |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _row(r):
    return (
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} "
        f"| {r[7]:.3f} | {r[8]:.3f}, {r[9]:.3f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every backend, one subprocess each")
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument(
        "--steps", type=int, default=20, help="at most; fewer for slow configurations"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--jit-compile",
        default="auto",
        choices=list(JIT_COMPILE),
        help="as `compile(jit_compile=...)`; `auto` is graph mode for TF on a CPU, XLA on a GPU",
    )
    args = parser.parse_args()
    if args.steps < MIN_STEPS:
        parser.error(
            f"--steps must be at least {MIN_STEPS} (the first {TIMER_SKIP} steps of "
            f"each epoch are not timed), got {args.steps}"
        )
    if args.rounds < 1 or args.batch < 1:
        parser.error(f"--rounds and --batch must be positive, got {args.rounds} and {args.batch}")
    if args.all:
        print(HEADER)
        for backend in BACKENDS:
            env = dict(os.environ, KERAS_BACKEND=backend)
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--rounds",
                    str(args.rounds),
                    "--steps",
                    str(args.steps),
                    "--batch",
                    str(args.batch),
                    "--policies",
                    *args.policies,
                    "--models",
                    *args.models,
                    "--jit-compile",
                    args.jit_compile,
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            print(
                "\n".join(ln for ln in out.splitlines() if ln.startswith(f"| {backend}")),
                flush=True,
            )
        return
    print(HEADER)
    jit = JIT_COMPILE[args.jit_compile]
    for r in run_one_backend(args.rounds, args.steps, args.batch, args.policies, args.models, jit):
        print(_row(r), flush=True)


if __name__ == "__main__":
    main()
