"""The share of a train step's matmul FLOPs in half, read from the program
each backend builds, for every family of the model zoo (`tests/zoo`), at O2
and O3 in bfloat16 and float16, beside Keras's own mixed policies and the
speed report's prediction.

JAX's lowered HLO, TensorFlow's traced graph, PyTorch's dispatched ops
(`keras_mp/_src/tools/compiled_census.py`); nothing is timed, so a CPU
answers (the tiny configurations of the zoo: the shares, not the sizes,
are the families').

    python benchmarks/compiled_share.py                      # every backend
    KERAS_BACKEND=jax python benchmarks/compiled_share.py --families gemma gpt2
"""

import argparse
import os
import subprocess
import sys

import _checkout  # noqa: F401  (this checkout's keras_mp, and the repository's tests)

BACKENDS = ("tensorflow", "jax", "torch")
CELLS = (("O2", "bfloat16"), ("O3", "bfloat16"), ("O2", "float16"), ("O3", "float16"))


def _build(keras, families, family, policy="float32"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    try:
        return getattr(families, family)()
    finally:
        keras.config.set_dtype_policy("float32")


def _share(census):
    return f"{100 * census.half_share:.1f}"


def one_backend(names):
    import keras

    import keras_mp
    from keras_mp._src import backends
    from keras_mp._src.precision import layer_tree
    from keras_mp._src.tools import compiled_census
    from tests.zoo import families

    backend = keras.backend.backend()
    for family in names:
        keras_shares = {}
        for dtype in ("bfloat16", "float16"):
            model, x, y, loss = _build(keras, families, family, f"mixed_{dtype}")
            model.compile(optimizer="adam", loss=loss)
            try:
                keras_shares[dtype] = _share(compiled_census.census(model, x, y))
            except Exception as e:  # noqa: BLE001 (Keras's own policy fails here)
                keras_shares[dtype] = f"fails ({type(e).__name__})"
        model, x, y, loss = _build(keras, families, family)
        # Before the output rule: the model's output layers in float32, as
        # `deny=` keeps them now.
        outputs = [layer for layer in layer_tree.output_layers(model) if layer is not model]
        model.compile(
            optimizer="adam", loss=loss, amp_level="O2", amp_dtype="bfloat16", amp_deny=outputs
        )
        cells = [_share(compiled_census.census(model, x, y))]
        model.compile(
            optimizer="adam", loss=loss, amp_level="O2", amp_dtype="bfloat16", amp_deny=[]
        )
        for level, dtype in CELLS:
            if not backends.current.computes_half_matmuls(dtype):
                cells.append("n/a: float32 matmuls here")
                continue
            model.compile(optimizer="adam", loss=loss, amp_level=level, amp_dtype=dtype)
            census = compiled_census.census(model, x, y)
            report = keras_mp.speed_report(model, x, level=level, dtype=dtype).summary
            cells.append(f"{_share(census)} ({100 * report['half_flop_share']:.0f})")
        print(
            f"| {backend} | {family} | "
            + " | ".join(cells)
            + f" | {keras_shares['bfloat16']} | {keras_shares['float16']} |",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=None, help="default: the whole zoo")
    parser.add_argument("--one", action="store_true", help="this process's backend only")
    args = parser.parse_args()
    if args.one:
        from tests.zoo import families

        return one_backend(args.families or list(families.FAMILIES))
    print(
        "| backend | family | O2 bfloat16, before | O2 bfloat16 (report) | O3 bfloat16 "
        "| O2 float16 | O3 float16 | Keras mixed_bfloat16 | Keras mixed_float16 |\n"
        "|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    backends = [os.environ["KERAS_BACKEND"]] if "KERAS_BACKEND" in os.environ else BACKENDS
    for backend in backends:
        command = [sys.executable, __file__, "--one"]
        if args.families:
            command += ["--families", *args.families]
        out = subprocess.run(
            command,
            env=dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3"),
            capture_output=True,
            text=True,
        )
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith("|")))
        if out.returncode:
            print(f"# {backend}: exit {out.returncode}: {out.stderr.strip()[-300:]}")


if __name__ == "__main__":
    main()
