"""Issue 64.2: the speed report's bound holds against every measured row.

Each speed-up of a keras_mp level over O0 that `benchmarks/README.md`
reports, GPU and CPU, is read from its table and set beside the bound
`speed_report` computes for the same model, batch, level, dtype and device
(a GPU's data sheet; a CPU's matmul rates as the table records them). A
new measurement that beats its bound fails here until the model of
`gpu_peaks.py` / `speed_model.py` is fixed.

The bound is a function of the model's shapes and the device's rates, not
of the backend that computes the symbolic pass, so one backend checks it
(PyTorch: the shortest of the three suites).
"""

import functools
import re
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp._src.backends import gpu_peaks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "benchmarks" / "README.md"
# The CPU tables' ratios carry the 2-core machine's noise floor (README).
CPU_NOISE = 0.05
LEVEL = re.compile(r"^(O[123]) (float16|bfloat16|float8)$")
NUMBER = re.compile(r"(\d+(?:\.\d+)?)")

pytestmark = pytest.mark.one_backend


def sections():
    """`{heading: text}` of the README's `## ` sections."""
    parts = re.split(r"^## (.+)$", README.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def table(text):
    """The first markdown table of `text`, as a list of `{header: cell}`."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def ratio(cell):
    """The speed-up a cell gives (`"2.53"`, `"1.14x"`, `"9x"`, `"557.5 (1.77)"`),
    None for an empty cell or one that says why there is none (`"n/a: ..."`);
    anything else fails: a cell this test cannot read is a row it would skip."""
    cell = cell.strip()
    if not cell or cell.startswith("n/a"):
        return None
    found = re.search(r"\((\d+(?:\.\d+)?)\)$", cell) or re.fullmatch(
        r"(\d+(?:\.\d+)?)\s*[x×]?", cell
    )
    assert found, f"a speed-up cell this test cannot read: {cell!r}"
    return float(found.group(1))


def section(found, start):
    """The text of the README section whose heading starts with `start`."""
    texts = [text for heading, text in found.items() if heading.startswith(start)]
    assert len(texts) == 1, f"benchmarks/README.md needs one section '{start}...'"
    return texts[0]


def gpu_of(text):
    found = re.search(r"\b(H100|H200|A100|L4|T4)\b", text)
    assert found, "a GPU table names its GPU"
    return found.group(1)


def measured_rows():
    """`(where, device, model, batch, level, dtype, speed-up, "tf32" | "strict")`
    of each measured speed-up over O0 the README reports."""
    found = sections()
    rows = []
    real = section(found, "How far from 2x float32")
    batches = {"gemma": 16, "resnet50": 128}
    for row in table(real):
        match = LEVEL.match(row["configuration"])
        speedups = [ratio(row[c]) for c in ("over O0", "over strict float32")]
        if row["configuration"].startswith(("O1", "O2", "O3")) and any(speedups):
            # A keras_mp level's speed-up: this test must be able to check it.
            assert match and row["model"] in batches, f"a row the bound cannot check: {row}"
        if not match or row["model"] not in batches:
            continue
        where = f"real models: {row['backend']} {row['model']} {row['configuration']}"
        level, dtype = match.groups()
        batch = batches[row["model"]]
        # PyTorch's O0 computes strict float32 (TF32 off), JAX's TF32.
        o0 = "strict" if row["backend"] == "torch" else "tf32"
        for column, kind in (("over O0", o0), ("over strict float32", "strict")):
            if ratio(row[column]) is not None:
                args = (gpu_of(real), row["model"], batch, level, dtype, ratio(row[column]), kind)
                rows.append((where + f" ({column})", *args))
    levels = section(found, "How fast is each level? (GPU)")
    for row in table(levels):
        match = LEVEL.match(row["configuration"])
        if not match:
            assert row["configuration"].startswith("Keras "), f"a row the bound cannot check: {row}"
            continue
        for column, cell in row.items():
            if column == "configuration" or ratio(cell) is None:
                continue
            backend, model = column.split()[:2]
            batch = 2048 if model == "mlp_large" else 64
            kind = "strict" if backend == "torch" else "tf32"
            rows.append(
                (f"levels (GPU): {column} {row['configuration']}", gpu_of(levels), model,
                 batch, *match.groups(), ratio(cell), kind)
            )  # fmt: skip
    same = section(found, "Is O2 float16 as fast as Keras's mixed_float16? (GPU)")
    for row in table(same):
        for config in (c for c in row if c.startswith(("O1", "O2", "O3"))):
            assert LEVEL.match(config), f"a column the bound cannot check: {config!r}"
            if ratio(row[config]) is not None:
                batch = 2048 if row["model"] == "mlp_large" else 64
                rows.append(
                    (f"O2 against Keras (GPU): {row['backend']} {row['model']} {config}",
                     gpu_of(same), row["model"], batch, *config.split(), ratio(row[config]),
                     "tf32")
                )  # fmt: skip
    cpu = section(found, "Does bfloat16 pay on a CPU?")
    for row in table(cpu):
        rates = next(v for k, v in row.items() if k.startswith("matmul GFLOP/s"))
        float32, bfloat16 = (float(n) * 1e9 for n in NUMBER.findall(rates))
        bandwidth = float(row["memory GB/s"]) * 1e9
        device = gpu_peaks.Peaks(
            f"the README's CPU with {row['backend']}", bfloat16, bfloat16, None, float32,
            bandwidth, kind="cpu",
        )  # fmt: skip
        for config in (c for c in row if c.startswith(("O1", "O2", "O3"))):
            assert LEVEL.match(config), f"a column the bound cannot check: {config!r}"
            if ratio(row[config]) is not None:
                rows.append(
                    (f"CPU: {row['backend']} {row['model']} {config}", device, row["model"],
                     16, *config.split(), ratio(row[config]), "tf32")
                )  # fmt: skip
    return rows


@functools.cache
def model_and_batch(name, batch):
    """The benchmark's own model (the scripts under `benchmarks/` build
    them) and a symbolic batch of `batch`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import amp_levels
    import cpu_models
    import real_models

    keras.utils.set_random_seed(0)
    if name in ("mlp_large", "transformer_large"):
        model, shape = amp_levels._build(keras, name)
        return model, np.zeros((batch,) + shape, "float32")
    if name == "gemma" or (name == "resnet50" and batch != cpu_models.BATCH):
        model, _, data = real_models._build(keras, name, tiny=False)
        return model, data(batch)[0]
    model, _, (x, _) = cpu_models._build(keras, name)
    return model, x


@functools.cache
def bounds(device, name, batch, level, dtype):
    model, x = model_and_batch(name, batch)
    summary = keras_mp.speed_report(model, x, level, dtype, device=device).summary
    return summary["speedup_bound_tf32"], summary["speedup_bound_float32"]


def test_the_readme_has_rows_of_every_kind():
    rows = measured_rows()
    assert {r[2] for r in rows} >= {"gemma", "resnet50", "mlp_large", "transformer_large"}
    assert {r[2] for r in rows if r[0].startswith("CPU:")} >= {"bert", "gpt2", "resnet50"}


def test_a_cell_it_cannot_read_fails_instead_of_being_skipped():
    assert ratio("1.16x") == 1.16 and ratio("9x") == 9 and ratio("557.5 (1.77)") == 1.77
    assert ratio("") is None and ratio("n/a: bfloat16 matmul 1.2 GFLOP/s") is None
    with pytest.raises(AssertionError, match="cannot read"):
        ratio("faster")


@pytest.mark.parametrize("row", measured_rows(), ids=lambda r: r[0])
def test_no_measured_speedup_beats_its_bound(row):
    where, device, name, batch, level, dtype, measured, kind = row
    tf32, strict = bounds(device, name, batch, level, dtype)
    bound = tf32 if kind == "tf32" else strict
    slack = 1 + CPU_NOISE if where.startswith("CPU:") else 1
    assert measured <= bound * slack, (
        f"{where}: measured {measured:.2f}x, speed_report's bound {bound:.2f}x"
    )
