"""LeNet-5 at every precision level, with fixed and dynamic loss scales.

A Keras port of the LeNet-5 scenario of MindSpore's mixed-precision tutorial:
conv 6@5x5, pool, conv 16@5x5, pool, dense 120, 84, 10; momentum SGD
(0.01, 0.9); batch 32; 32x32x1 images: scikit-learn's handwritten digits
(8x8, shipped with scikit-learn), upscaled. Each level runs with

- a fixed scale of 1024, skipping overflowing steps (MindSpore's
  `FixedLossScaleManager(1024, drop_overflow_update=True)`),
- the same fixed scale applied unchecked (`drop_overflow_update=False`),
- a dynamic scale growing by 4 after 3000 clean steps and shrinking by 4 on
  overflow (`DynamicLossScaleManager(scale_factor=4, scale_window=3000)`),

(O0 runs once, without scaling), and prints test accuracy, the final loss
scale ("-" where there is none), skipped steps and time per step.

    pip install ".[examples]"
    python examples/lenet5_amp.py
    KERAS_BACKEND=torch python examples/lenet5_amp.py --dtype bfloat16 --levels O0 O2
"""

import argparse
import time

LEVELS = ("O0", "O1", "O2", "O3")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16"],
        help="the half dtype of O1-O3",
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train on this many batches per epoch only (a quick check)",
    )
    parser.add_argument(
        "--levels", nargs="+", default=list(LEVELS), choices=LEVELS, help="the levels to run"
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


def load_digits():
    """Digits upscaled to 32x32x1 in [0, 1]: 1437 training, 360 test images."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as e:
        raise SystemExit(
            'LeNet-5 trains on scikit-learn\'s digits: pip install ".[examples]"'
        ) from e
    digits = sklearn_digits()
    images = (digits.images / 16.0).astype("float32")
    images = np.repeat(np.repeat(images, 4, axis=1), 4, axis=2)[..., None]  # 8x8 -> 32x32
    labels = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    return (images[:1437], labels[:1437]), (images[1437:], labels[1437:])


def lenet5():
    return keras.Sequential(
        [
            keras.Input((32, 32, 1)),
            keras.layers.Conv2D(6, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu"),
            keras.layers.Dense(84, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="lenet5",
    )


def scale_settings(level):
    if level == "O0":
        return {"no scaling": None}
    return {
        "fixed 1024, skip": dict(dynamic=False, initial_scale=1024.0),
        "fixed 1024, no skip": dict(dynamic=False, initial_scale=1024.0, skip_on_overflow=False),
        "dynamic x4 / 3000": dict(
            dynamic=True,
            initial_scale=2.0**15,
            growth_factor=4.0,
            backoff_factor=0.25,
            dynamic_growth_steps=3000,
        ),
    }


class EpochTimer(keras.callbacks.Callback):
    """Time per step of the last epoch (the first one compiles the step)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.per_step = (time.perf_counter() - self.start) / self.params["steps"]


def run(level, settings, dtype, data, args):
    (x, y), (x_test, y_test) = data
    keras.utils.set_random_seed(0)
    model = lenet5()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if settings is not None:
        optimizer = keras_mp.LossScaleOptimizer(optimizer, **settings)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level=level,
        **({} if level == "O0" else {"amp_dtype": dtype}),
        loss_scale=None,  # the optimizer above decides
    )
    timer = EpochTimer()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        verbose=0,
        callbacks=[timer],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    optimizer = model.optimizer
    if isinstance(optimizer, keras_mp.LossScaleOptimizer):
        scale = f"{float(keras.ops.convert_to_numpy(optimizer.loss_scale)):.0f}"
        skipped = f"{int(keras.ops.convert_to_numpy(optimizer.skipped_steps))}"
    else:
        scale = skipped = "-"
    return accuracy, scale, skipped, timer.per_step


def main(args=None):
    """Runs every level; `args` as `parse_args` returns them, or a list of strings."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    data = load_digits()
    print(
        f"LeNet-5 on digits upscaled to 32x32: backend {keras.backend.backend()}, "
        f"{args.dtype}, {args.epochs} epochs of {args.steps or -(-len(data[0][0]) // BATCH)} "
        f"steps, momentum SGD (0.01, 0.9)\n"
    )
    header = f"{'level':6}{'loss scale':22}{'test accuracy':>14}{'scale':>8}{'skipped':>9}"
    print(header + f"{'time per step':>15}")
    print("-" * (len(header) + 15))
    results = {}
    for level in args.levels:
        for label, settings in scale_settings(level).items():
            accuracy, scale, skipped, per_step = run(level, settings, args.dtype, data, args)
            results[(level, label)] = accuracy
            print(
                f"{level:6}{label:22}{accuracy:14.4f}{scale:>8}{skipped:>9}"
                f"{per_step * 1e3:12.2f} ms",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main(ARGS)
