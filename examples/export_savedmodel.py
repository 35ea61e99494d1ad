"""Train in mixed precision, export a float32 SavedModel, serve it with TensorFlow alone.

1. Trains a small classifier at `amp_level="O2"` (float16 compute, float32
   master weights, dynamic loss scaling) on generated data.
2. Saves it as `.keras` (to resume training) and exports two SavedModels:
   - `model.export(...)`: the model as trained (float16 kernels inside,
     float32 in and out): for a GPU;
   - `keras_mp.export(model, ..., dtype="float32")`: a copy re-traced in
     float32, for serving on a CPU at full speed. The training model is not
     touched.
3. Serves a prediction from each SavedModel in a separate Python process that
   imports only TensorFlow and NumPy (no Keras, no keras_mp), and compares it
   with the in-memory model's.

    python examples/export_savedmodel.py --out /tmp/keras_mp_export
    KERAS_BACKEND=jax python examples/export_savedmodel.py   # JAX exports too
"""

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np

import keras_mp

SERVE = textwrap.dedent(
    """
    import os
    import sys
    import numpy as np
    import tensorflow as tf

    x, expected = np.load(sys.argv[1]), np.load(sys.argv[2])
    for path in sys.argv[3:]:
        print(f"serving {os.path.basename(path)} with TensorFlow alone:")
        loaded = tf.saved_model.load(path)
        serve = loaded.signatures["serving_default"]
        (name, spec), = serve.structured_input_signature[1].items()
        (out,) = serve(**{name: tf.constant(x)}).values()
        print(f"  input {name!r} {spec.dtype.name}{list(spec.shape)} -> "
              f"output {out.dtype.name}{list(out.shape)}; "
              f"variables: {sorted({v.dtype.name for v in loaded.variables})}")
        print("  predicted classes:", out.numpy().argmax(axis=1).tolist())
        print("  largest difference from the in-memory model: "
              f"{np.abs(out.numpy() - expected).max():.2e}")
    """
)


def make_data(n, features=20, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=0.5, size=(classes, features))
    y = rng.integers(0, classes, size=n)
    return (centers[y] + rng.normal(size=(n, features))).astype("float32"), y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="folder for the artifacts (default: a temporary one)"
    )
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="keras_mp_export_")
    os.makedirs(out, exist_ok=True)

    keras.utils.set_random_seed(0)
    x, y = make_data(2048)
    inputs = keras.Input((x.shape[1],), name="features")
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        amp_level="O2",
    )
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0)
    print(
        f"trained {args.epochs} epochs at O2 (float16) on {keras.backend.backend()}: "
        f"accuracy {history.history['accuracy'][-1]:.3f}, loss scale "
        f"{float(keras.ops.convert_to_numpy(model.optimizer.loss_scale)):g}"
    )

    model.save(os.path.join(out, "model.keras"))
    as_trained = os.path.join(out, "saved_model_as_trained")
    model.export(as_trained, verbose=False)
    for_cpu = os.path.join(out, "saved_model_float32")
    keras_mp.export(model, for_cpu, dtype="float32", verbose=False)
    print(f"saved {out}/model.keras; exported {as_trained} and {for_cpu}")

    sample, expected = os.path.join(out, "sample.npy"), os.path.join(out, "expected.npy")
    np.save(sample, x[:5])
    np.save(expected, model.predict(x[:5], verbose=0))
    # Both SavedModels, served in one new process that imports no Keras.
    subprocess.run([sys.executable, "-c", SERVE, sample, expected, as_trained, for_cpu], check=True)


if __name__ == "__main__":
    main()
