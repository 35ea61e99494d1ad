"""How much of a train step's matmul work `amp_dtype="float8"` puts in FP8,
read from the program each backend builds (nothing timed: a CPU answers).

For the FP8-aligned KerasHub families of the zoo (`tests/zoo/families.py`:
Gemma, GPT-2, BERT with dimensions multiples of 16) and the digits MLP, at
O2 and O3 float8: the layers `precision_summary` puts in FP8, the matmuls
of the compiled step that multiply FP8 values (three a layer: forward and
both gradients), those whose two operands are FP8 in the program itself
(`compiled_census.fp8_gemms`: JAX's `dot_general` on FP8 operands,
PyTorch's `_scaled_mm`; TensorFlow multiplies quantized-dequantized
values), and their share of the step's matmul FLOPs, beside
`speed_report`'s. The size rule is off (`Float8Recipe(small_gemm=None)`):
the zoo's layers are far below the size where FP8 pays.

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
    from keras_mp._src.tools import compiled_census
    from tests.zoo import families

    builders = {**families.FP8, "digits MLP": families.fp8_mlp}
    model_recipe = keras_mp.Float8Recipe(small_gemm=None)
    for name, build in builders.items():
        for level in ("O2", "O3"):
            keras.utils.set_random_seed(0)
            model, x, y, loss = build()
            # The zoo's widths are far below the size where FP8 pays: the
            # size rule (`small_gemm`) off, so that every aligned layer is FP8.
            model.compile(
                optimizer="adam",
                loss=loss,
                amp_level=level,
                amp_dtype="float8",
                float8_recipe=model_recipe,
            )
            rows = keras_mp.precision_summary(model).rows
            chosen = sum("matmul in FP8" in r["rule"] for r in rows)
            found = backends.current.train_step_matmuls(model, (x, y))
            total = sum(n for _, _, n in found)
            fp8 = [n for _, dtype, n in found if dtype == "float8"]
            report = keras_mp.speed_report(
                model, x, level=level, dtype="float8", float8_recipe=model_recipe
            ).summary
            gemms = compiled_census.fp8_gemms(model, x, y)
            real = ", ".join(f"{n} {pair}" for pair, n in sorted(gemms.items())) or "none"
            print(
                f"| {keras.backend.backend()} | {name} | {level} | {chosen} | {len(fp8)} "
                f"| {real} | {100 * sum(fp8) / total:.1f}% "
                f"| {100 * report['float8_flop_share']:.1f}% |",
                flush=True,
            )


def main():
    if os.environ.get("KERAS_BACKEND") or len(sys.argv) > 1:
        one_backend()
        return
    print(
        "| backend | family | level | layers in FP8 | FP8 matmuls in the step "
        "| FP8 x FP8 GEMMs (operands' dtypes) | FP8 share of matmul FLOPs | speed_report's |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for backend in BACKENDS:
        env = dict(os.environ, KERAS_BACKEND=backend)
        subprocess.run([sys.executable, __file__, "--one"], env=env, check=True)


if __name__ == "__main__":
    main()
