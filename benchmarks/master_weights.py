"""What master weights cost and save (a benchmark, not a test).

For one model of a few million parameters (an MLP, 256 -> 3 x 1024 -> 10,
3.4M weights; `--width` for another size), trained with Adam: the bytes of
the model's variables plus the optimizer's (master copies and slots
included), and the time per `fit` step, of

- O0; O2 (float32 variables, half compute);
- O3 with float32 master weights (the default) and without
  (`master_weights=False`: Keras's behaviour, bfloat16 weights stop learning),
- O3 bfloat16 with compensated updates (`master_weights="compensated"`:
  bfloat16 Kahan buffers, no float32 copy),

in float16 and bfloat16, in one process, alternating the configurations
round by round, median over rounds. The byte counts are exact (shapes times
item sizes), not a measure of the allocator; activations are not counted.

    KERAS_BACKEND=jax python benchmarks/master_weights.py
"""

import argparse
import statistics

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from lso_overhead import _steady_state_timer

CONFIGS = (
    "O0",
    "O2 float16",
    "O3 float16",
    "O3 float16 no masters",
    "O2 bfloat16",
    "O3 bfloat16",
    "O3 bfloat16 no masters",
    "O3 bfloat16 compensated",
)


def _compiled(keras, config, width):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((256,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(3)]
    model = keras.Sequential(layers + [keras.layers.Dense(10, activation="softmax")])
    parts = config.split()
    level, dtype = parts[0], (parts[1] if len(parts) > 1 else "float16")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        amp_dtype=dtype,
        master_weights={"masters": False, "compensated": "compensated"}.get(parts[-1]),
    )
    return model


def _bytes(keras, variables):
    import numpy as np

    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        if keras.backend.standardize_dtype(v.dtype) != "bfloat16"
        else int(np.prod(v.shape)) * 2
        for v in variables
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    if min(args.rounds, args.steps, args.batch, args.width) < 1 or args.steps < 4:
        parser.error("--rounds, --batch and --width must be positive, --steps at least 4")

    import keras
    import numpy as np

    import keras_mp  # noqa: F401  (the amp keywords)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 256)).astype("float32")
    y = rng.integers(0, 10, size=(args.steps * args.batch,))
    models = {}
    for config in CONFIGS:
        models[config] = _compiled(keras, config, args.width)
        models[config].fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # build, trace
    timer = _steady_state_timer(keras)(skip=2)
    times = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            models[config].fit(x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=[timer])
            times[config].append(timer.per_step)
    o0 = statistics.median(times["O0"])
    params = models["O0"].count_params()
    print(
        f"# {keras.backend.backend()}, {params / 1e6:.1f}M weights, batch {args.batch}, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print("| configuration | model variables | optimizer variables | total | step | step / O0 |")
    print("|---|---|---|---|---|---|")
    for config in CONFIGS:
        model = models[config]
        own = _bytes(keras, model.weights)
        optimizer = _bytes(keras, model.optimizer.variables)
        step = statistics.median(times[config])
        print(
            f"| {config} | {own / 2**20:.1f} MiB | {optimizer / 2**20:.1f} MiB "
            f"| {(own + optimizer) / 2**20:.1f} MiB | {step * 1e3:.2f} ms | {step / o0:.2f} |"
        )


if __name__ == "__main__":
    main()
