"""How much of a train step's matmul work `amp_dtype="float8"` puts in FP8,
read from the program each backend builds (nothing timed: a CPU answers).

For the FP8-aligned KerasHub families of the zoo (`tests/zoo/families.py`:
Gemma, GPT-2, BERT with dimensions multiples of 16) and the digits MLP, at
O2 and O3 float8: the layers `precision_summary` puts in FP8, the matmuls
of the compiled step that multiply two values quantized to FP8 and back
(three a layer: forward and both gradients), and their share of the
step's matmul FLOPs, beside `speed_report`'s.

    python benchmarks/fp8_share.py                # every backend
    KERAS_BACKEND=jax python benchmarks/fp8_share.py
"""

import os
import subprocess
import sys

import _checkout  # noqa: F401  (this checkout's keras_mp, and the repository's tests)

BACKENDS = ("tensorflow", "jax", "torch")


def one_backend():
    import keras

    import keras_mp
    from keras_mp._src import backends
    from tests.zoo import families

    builders = {**families.FP8, "digits MLP": families.fp8_mlp}
    for name, build in builders.items():
        for level in ("O2", "O3"):
            keras.utils.set_random_seed(0)
            model, x, y, loss = build()
            model.compile(optimizer="adam", loss=loss, amp_level=level, amp_dtype="float8")
            rows = keras_mp.precision_summary(model).rows
            chosen = sum("matmul in FP8" in r["rule"] for r in rows)
            found = backends.current.train_step_matmuls(model, (x, y))
            total = sum(n for _, _, n in found)
            fp8 = [n for _, dtype, n in found if dtype == "float8"]
            report = keras_mp.speed_report(model, x, level=level, dtype="float8").summary
            print(
                f"| {keras.backend.backend()} | {name} | {level} | {chosen} | {len(fp8)} "
                f"| {100 * sum(fp8) / total:.1f}% | {100 * report['float8_flop_share']:.1f}% |",
                flush=True,
            )


def main():
    if os.environ.get("KERAS_BACKEND") or len(sys.argv) > 1:
        one_backend()
        return
    print(
        "| backend | family | level | layers in FP8 | FP8 matmuls in the step "
        "| FP8 share of matmul FLOPs | speed_report's |\n|---|---|---|---|---|---|---|"
    )
    for backend in BACKENDS:
        env = dict(os.environ, KERAS_BACKEND=backend)
        subprocess.run([sys.executable, __file__, "--one"], env=env, check=True)


if __name__ == "__main__":
    main()
