"""The main job: mixed precision at work on real data, in under a minute.

Trains a small classifier on scikit-learn's handwritten digits (8x8 images,
shipped with scikit-learn: nothing is downloaded) twice, from the same
initial weights: at O0 (float32) and at O2 (float16 compute, float32
weights, BatchNorm and output in float32, dynamic loss scaling). It shows

1. the dynamic loss scale finding its level: it starts far too high (2**24),
   the first steps overflow float16 and are skipped while the scale halves,
   then it holds;
2. a corrupted batch (a NaN in the inputs) skipped with nothing lost: the
   weights, Adam's slots and BatchNorm's statistics are unchanged, bit for bit;
3. O0 and O2 side by side: test accuracy, time per step and the speed-up
   over O0. On a CPU it also trains O2 bfloat16, which CPUs with AVX512-BF16
   or AMX compute natively, and says what `amp_level="auto"` picks on this
   one and why (this model's step predicted from what it times here), then
   what the speed report expects of this model here and on an H100.

    pip install ".[examples]"
    python examples/train_mixed_precision.py
    KERAS_BACKEND=jax python examples/train_mixed_precision.py
    python examples/train_mixed_precision.py --dtype bfloat16 --epochs 5
"""

import argparse
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=12, help="epochs per level")
    parser.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16"],
        help="the half dtype of O2 (bfloat16 needs no loss scale)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train on this many batches per epoch only (a quick check)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # `--help` answers before Keras is imported
    import _quiet

    _quiet.import_keras()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402

BATCH = 32
INITIAL_SCALE = 2.0**24


def load_digits():
    """Digits scaled to [0, 1]: 1437 training and 360 test images."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as e:
        raise SystemExit(
            'The main job trains on scikit-learn\'s digits: pip install ".[examples]"'
        ) from e
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def build_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


class Recorder(keras.callbacks.Callback):
    """The loss scale after every step, and the time of every epoch."""

    def __init__(self):
        super().__init__()
        self.scales = []
        self.epoch_times = []

    def on_train_batch_end(self, batch, logs=None):
        if "loss_scale" in logs:
            self.scales.append(float(logs["loss_scale"]))

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_times.append(time.perf_counter() - self.start)
        last = epoch + 1 == self.params["epochs"]
        if epoch < 2 or (epoch + 1) % 4 == 0 or last:
            scaling = (
                f"  loss_scale {logs['loss_scale']:.0f}  skipped_steps {logs['skipped_steps']:.0f}"
                if "loss_scale" in logs
                else ""
            )
            print(
                f"  epoch {epoch + 1:2d}: loss {logs['loss']:.4f}  "
                f"accuracy {logs['accuracy']:.4f}{scaling}"
            )


def train(level, dtype, initial_weights, data, args):
    (x, y), (x_test, y_test) = data
    keras.utils.set_random_seed(1)
    model = build_model()
    model.set_weights(initial_weights)
    optimizer = keras.optimizers.Adam(1e-3)
    if level != "O0" and dtype == "float16":
        optimizer = keras_mp.LossScaleOptimizer(optimizer, initial_scale=INITIAL_SCALE)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level=level,
        **({} if level == "O0" else {"amp_dtype": dtype}),
    )
    recorder = Recorder()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        verbose=0,
        callbacks=[recorder],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    # The first epoch compiles the step: time the others.
    times = recorder.epoch_times[1:] or recorder.epoch_times
    steps = args.steps or -(-len(x) // BATCH)
    return model, recorder, accuracy, 1e3 * float(np.median(times)) / steps


def scale_story(scales, initial=INITIAL_SCALE):
    """The scale's changes, step by step: runs of backed-off steps, growth."""
    lines, previous, step = [], initial, 0
    while step < len(scales):
        if scales[step] == previous:
            step += 1
            continue
        first, direction = step, scales[step] < previous
        while (
            step < len(scales)
            and scales[step] != previous
            and (scales[step] < previous) == direction
        ):
            previous = scales[step]
            step += 1
        steps = f"step {first + 1}" if step == first + 1 else f"steps {first + 1}-{step}"
        what = "overflow: skipped, the scale halved" if direction else "grew"
        lines.append(
            f"  {steps + ':':14}{what}{' each time' if step > first + 1 else ''}, to {previous:.0f}"
        )
    lines.append(f"  then it held at {previous:.0f} to the end (step {len(scales)})")
    return "\n".join(lines)


def skip_a_bad_batch(model, data):
    """One batch with a NaN input: the step is skipped, nothing changes."""
    (x, y), _ = data
    x_bad = x[:BATCH].copy()
    x_bad[3, 10] = np.nan  # a corrupted record
    optimizer = model.optimizer
    state = model.variables + optimizer.inner_optimizer.variables

    def snapshot():
        return [np.array(keras.ops.convert_to_numpy(v)) for v in state]

    def read(variable):
        return float(keras.ops.convert_to_numpy(variable))

    before, scale, skipped = snapshot(), read(optimizer.loss_scale), read(optimizer.skipped_steps)
    model.train_on_batch(x_bad, y[:BATCH])
    after = snapshot()
    unchanged = all(np.array_equal(b, a) for b, a in zip(before, after))
    count = len(model.variables) + len(optimizer.inner_optimizer.variables)
    print(
        f"  skipped_steps {skipped:.0f} -> {read(optimizer.skipped_steps):.0f}, "
        f"loss_scale {scale:.0f} -> {read(optimizer.loss_scale):.0f}\n"
        f"  the {count} variables (weights, BatchNorm statistics, Adam's slots): "
        + ("unchanged, bit for bit" if unchanged else "CHANGED")
    )
    return unchanged


def on_gpu():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    if backend == "jax":
        import jax

        return jax.default_backend() == "gpu"
    import torch

    return torch.cuda.is_available()


def main(args=None):
    """Runs the job; `args` as `parse_args` returns them, or a list of strings."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    data = load_digits()
    (x, _), (x_test, _) = data
    keras.utils.set_random_seed(0)
    initial_weights = build_model().get_weights()
    device = "GPU" if on_gpu() else "CPU"
    print(
        f"keras_mp main job: digits ({len(x)} training, {len(x_test)} test images), "
        f"backend {keras.backend.backend()} on the {device}, batch {BATCH}, "
        f"{args.epochs} epochs per level\n"
    )

    print(f"O2 {args.dtype}: Dense layers compute in {args.dtype}; BatchNorm, the output and")
    print("the weights stay float32.")
    o2, recorder, o2_accuracy, o2_ms = train("O2", args.dtype, initial_weights, data, args)
    if args.dtype == "float16":
        print(f"\nThe dynamic loss scale, from {INITIAL_SCALE:.0f} (2**24: far too high):")
        print(scale_story(recorder.scales))
        print("\nA corrupted batch (a NaN in one image) is skipped with nothing lost:")
        skip_a_bad_batch(o2, data)
    rows = [(f"O2 {args.dtype}", o2, o2_accuracy, o2_ms)]
    if device == "CPU" and args.dtype != "bfloat16":
        # What CPUs with native bfloat16 (AVX512-BF16, AMX) compute fast.
        print("\nO2 bfloat16, from the same initial weights:")
        model, _, accuracy, ms = train("O2", "bfloat16", initial_weights, data, args)
        rows.append(("O2 bfloat16", model, accuracy, ms))

    print("\nO0 float32, from the same initial weights:")
    _, _, o0_accuracy, o0_ms = train("O0", "float32", initial_weights, data, args)

    print(
        f"\n{'level':14}{'test accuracy':>15}{'time per step':>16}{'over O0':>9}{'loss scale':>12}"
    )
    print(f"{'O0 float32':14}{o0_accuracy:15.4f}{o0_ms:13.2f} ms{1:8.2f}x{'-':>12}")
    for name, model, accuracy, ms in rows:
        scale = float(keras.ops.convert_to_numpy(getattr(model.optimizer, "loss_scale", np.nan)))
        print(
            f"{name:14}{accuracy:15.4f}{ms:13.2f} ms{o0_ms / ms:8.2f}x"
            f"{'-' if np.isnan(scale) else f'{scale:g}':>12}"
        )
    if args.epochs == 1:
        print("(one epoch: its times include compiling the step; --epochs 2 or more to compare)")
    if device == "CPU":
        # `auto` reads this CPU's flags and, where they say bfloat16 could
        # pay, predicts this model's step at O0 and O2 from what it times
        # here; it says what it picked and why.
        print()
        build_model().compile(optimizer="adam", loss="mse", amp_level="auto")
    # What this machine, and a GPU, would give this model (computed, not timed).
    reports = {}
    for where in ("this machine", "H100"):
        reports[where] = keras_mp.speed_report(
            build_model(), x[:BATCH], "O2", "bfloat16" if where != "H100" and device == "CPU"
            else args.dtype, device=None if where == "this machine" else where,
        )  # fmt: skip
        print(f"\nSpeed report ({where}): {reports[where].verdict}")
    return {
        "O0": o0_accuracy,
        "O2": o2_accuracy,
        "scales": recorder.scales,
        "report": reports["H100"],
        "times": {"O0 float32": o0_ms, **{name: ms for name, _, _, ms in rows}},
    }


if __name__ == "__main__":
    main(ARGS)
