"""Real models at real sizes, each level against float32 (a benchmark for a GPU).

keras.applications' ResNet50 (batch 128, 224x224x3, channels-last) and a
~100M-parameter KerasHub Gemma built from a config (batch 16 x 512 tokens),
random weights, nothing downloaded. Per backend, in one process, the
configurations alternated round by round, medians over rounds:

- `O0` with the backend's own TF32 setting (TensorFlow and JAX use TF32 for
  float32 matmuls on Ampere and later; PyTorch does not), `O0 float32` with
  TF32 off, O2 float16, O2 bfloat16, O3 bfloat16, and Keras's own
  `mixed_float16` / `mixed_bfloat16` policies;
- each one's speed-up over both O0s, beside the bound `keras_mp.speed_report`
  predicts for it (`bound`: over O0 with TF32, `strict`: with TF32 off);
- `--memory`: peak device memory of each configuration (one process each:
  JAX's peak cannot be reset), beside the bytes of weights and optimizer
  state the model holds and the speed report's prediction of them;
- `--max-batch`: the largest power-of-two batch that trains, at O0 and at
  O2/O3 (one process per try: an out-of-memory error ends it).
- `--planned-memory B1 B2` (JAX): the temporaries XLA plans for the train
  step at two batches (compiled, not run), and the largest batch they leave
  room for on the device.

    python benchmarks/real_models.py --all                  # every backend
    KERAS_BACKEND=jax python benchmarks/real_models.py --models gemma
    python benchmarks/real_models.py --all --memory
    python benchmarks/real_models.py --all --max-batch --models gemma
    python benchmarks/real_models.py --all --tiny --rounds 1  # a CPU check

`--tiny` builds the same models small enough for a CPU (a check that the
script runs, not a measurement).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from _common import JIT_COMPILE
from _common import built_for
from _common import level_of
from lso_overhead import _steady_state_timer

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("resnet50", "gemma", "gemma1b")
CONFIGS = (
    "O0",
    "O0 float32",
    "O2 float16",
    "O2 bfloat16",
    "O3 bfloat16",
    "keras mixed_float16",
    "keras mixed_bfloat16",
    # The Gemma's output layer (the tied embedding's logits matmul) in half at
    # O2, its logits cast to float32 by the loss: the rule of issue 54.
    "O2 float16 +head",
    "O2 bfloat16 +head",
    # FP8 matmuls (Keras's float8 layers, XLA's FP8 GEMMs on H100/H200), and
    # with Adam's moments in FP8/float16 as well (issue 56).
    "O2 float8",
    "O2 float8 +moments",
)
BATCH = {"resnet50": 128, "gemma": 16, "gemma1b": 8}
# Each configuration's largest batch is searched at these levels.
MAX_BATCH_CONFIGS = ("O0", "O2 float16", "O2 bfloat16", "O3 bfloat16")
GPU_NAMES = ("H200", "H100", "A100", "L4", "T4")  # speed_report's table


def _build(keras, name, tiny):
    """The model, its loss, and a function of a batch size giving (x, y)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "resnet50":
        shape, classes = ((32, 32, 3), 10) if tiny else ((224, 224, 3), 1000)
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes)

        def data(batch, steps=1):
            x = rng.normal(size=(steps * batch,) + shape).astype("float32")
            return x, rng.integers(0, classes, size=(steps * batch,))

        return model, "sparse_categorical_crossentropy", data
    import keras_hub

    config = (
        dict(vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=2,
             hidden_dim=32, intermediate_dim=64, head_dim=16)
        if tiny
        # ~1.1B parameters: 65.5M in the embedding, 67.1M a layer (FP8's size).
        else dict(vocabulary_size=32000, num_layers=16, num_query_heads=16,
                  num_key_value_heads=16, hidden_dim=2048, intermediate_dim=16384, head_dim=128)
        if name == "gemma1b"
        # ~100M parameters: 24.6M in the embedding, 9.4M a layer.
        else dict(vocabulary_size=32000, num_layers=8, num_query_heads=12,
                  num_key_value_heads=12, hidden_dim=768, intermediate_dim=6144, head_dim=64)
    )  # fmt: skip
    backbone = keras_hub.models.GemmaBackbone(**config)
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    tokens = 16 if tiny else 512
    vocabulary = config["vocabulary_size"]

    def data(batch, steps=1):
        ids = rng.integers(0, vocabulary, size=(steps * batch, tokens + 1)).astype("int32")
        x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
        return x, ids[:, 1:]

    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), data


@contextlib.contextmanager
def _matmul_precision(keras, strict):
    """TF32 off for float32 matmuls and convolutions when `strict`; the
    backend's own setting otherwise. Set around every `fit` of a
    configuration (TensorFlow and PyTorch read it as they run, JAX as it
    traces)."""
    if not strict:
        yield
        return
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        before = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(False)
        try:
            yield
        finally:
            tf.config.experimental.enable_tensor_float_32_execution(before)
    elif backend == "jax":
        import jax

        with jax.default_matmul_precision("float32"):
            yield
    else:
        import torch

        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _compiled(keras, name, config, tiny, jit_compile):
    model, loss, data = built_for(keras, config, lambda: _build(keras, name, tiny))
    optimizer = keras.optimizers.Adam(1e-4)
    if config.startswith("keras "):
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
        return model, data
    level, dtype = level_of(config)
    if config.endswith("+moments"):
        import keras_mp

        optimizer = keras_mp.LossScaleOptimizer(
            optimizer, dynamic=False, initial_scale=1.0, moment_dtypes="float8"
        )
    model.compile(
        optimizer=optimizer,
        loss=loss,
        jit_compile=jit_compile,
        amp_level=level,
        amp_dtype="float16" if level == "O0" else dtype,
    )
    if config.endswith("+head"):
        if not name.startswith("gemma"):
            raise ValueError(f"{config!r} is the Gemma's head in half; {name} has none")
        # The tied embedding's own knob: its logits matmul (and the two of
        # its gradient) in `dtype`; the loss reads the logits in float32.
        model.backbone.token_embedding.reverse_dtype = dtype
    return model, data


def _gpu_name():
    """The speed report's name for this machine's GPU (H100 if unknown)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "H100"
    return next((g for g in GPU_NAMES if g in out.upper()), "H100")


def _bounds(keras, keras_mp, name, tiny, batch, gpu):
    """speed_report's bounds per keras_mp level, {config: (bound, strict)}
    (its rules are keras_mp's: Keras's own policies get none), and the
    step's matmul FLOPs (forward and backward), the same at every level."""
    model, _, data = _build(keras, name, tiny)
    x, _ = data(batch)
    bounds, flops = {}, None
    for config in CONFIGS:
        if not config.startswith(("O1", "O2", "O3")) or config.endswith(("+head", "+moments")):
            continue
        level, dtype = config.split()
        summary = keras_mp.speed_report(model, x, level=level, dtype=dtype, gpu=gpu).summary
        bounds[config] = (summary["speedup_bound_tf32"], summary["speedup_bound_float32"])
        flops = summary["flops_per_step"]
    return bounds, flops


def _peak_rate(gpu, config):
    """The GPU's matmul peak (FLOP/s) for the dtype a configuration's
    matmuls run in: TF32 for O0 as the backend sets it (TensorFlow and JAX;
    PyTorch computes float32), float32 without, FP8 for the float8 level."""
    from keras_mp._src.backends.gpu_peaks import peaks_of

    peaks = peaks_of(gpu)
    if config == "O0 float32":
        return peaks.float32
    if config == "O0":
        import keras

        return peaks.matmul_rate("float32", tf32=keras.backend.backend() != "torch")
    dtype = "float8" if "float8" in config else "bfloat16" if "bfloat16" in config else "float16"
    return peaks.matmul_rate(dtype)


@contextlib.contextmanager
def _gpu_turn(lock_path):
    """Holds the file lock `lock_path` (if any) while this process times:
    processes that share one GPU compile side by side and take turns on the
    clock."""
    if not lock_path:
        yield
        return
    import fcntl

    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_speed(name, configs, rounds, batch, tiny, jit_compile, lock=None, profile=(), until=None):
    """Each configuration compiled (one step, outside `lock`), then, holding
    `lock`: a warm epoch (its peak memory), `rounds` timed epochs alternating
    the configurations, and a kernel profile of the `profile` ones.
    Configurations not yet compiled at time `until` (seconds since the
    epoch) are skipped, so that the ones compiled are still timed."""
    import keras

    import keras_mp

    gpu = _gpu_name()
    bounds, flops = _bounds(keras, keras_mp, name, tiny, batch, gpu)
    models, failed, data = {}, {}, None
    steps = 3 if tiny else 12
    dump = _xla_dump_dir()
    seen, censuses, peaks = set(), {}, {}
    for config in configs:
        if until and time.time() > until:
            failed[config] = "skipped: the lease's time"
            continue
        try:
            model, make = _compiled(keras, name, config, tiny, jit_compile)
            data = data or make(batch, steps)  # the same batches for every configuration
            first = keras.tree.map_structure(lambda a: a[:batch], data)
            with _matmul_precision(keras, config == "O0 float32"):
                keras.Model.fit(model, *first, batch_size=batch, epochs=1, verbose=0)
            models[config] = model
        except Exception as e:  # e.g. out of memory: said in the table
            failed[config] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        if dump:
            censuses[config] = _census_of_new_module(dump, seen)
    timer = _steady_state_timer(keras)(skip=2 if steps > 4 else 1)
    ran = tuple(c for c in configs if c in models)
    times = {c: [] for c in ran}
    profiles = {}
    with _gpu_turn(lock):
        for config in ran:
            before = _reset_peak(keras)
            with _matmul_precision(keras, config == "O0 float32"):
                keras.Model.fit(models[config], *data, batch_size=batch, epochs=1, verbose=0)
            peak = _peak_bytes(keras)
            if before is not None and peak is not None:
                peaks[config] = (
                    peak - before,
                    _nbytes(models[config].weights),
                    _nbytes(models[config].optimizer.variables),
                )
        for r in range(rounds):
            for config in ran if r % 2 == 0 else ran[::-1]:
                with _matmul_precision(keras, config == "O0 float32"):
                    keras.Model.fit(
                        models[config], *data, batch_size=batch, epochs=1, verbose=0,
                        callbacks=[timer],
                    )  # fmt: skip
                times[config].append(timer.per_step)
        for config in (c for c in profile if c in models):
            profiles[config] = _kernels_of_an_epoch(keras, models[config], data, batch, config)
    median = {c: statistics.median(t) for c, t in times.items()}
    backend = keras.backend.backend()
    for config in configs:
        if config in failed:
            print(f"| {backend} | {name} | {config} | failed | | | {failed[config]} |")
            continue

        def over(base, c=config):
            return f"{median[base] / median[c]:.2f}" if base in median else "n/a"

        bound, strict = bounds.get(config, (None, None))
        predicted = "" if bound is None else f"{bound:.2f} / {strict:.2f}"
        mfu = flops / median[config] / _peak_rate(gpu, config)
        print(
            f"| {backend} | {name} | {config} | {median[config] * 1e3:.1f} "
            f"| {over('O0')} | {over('O0 float32')} | {predicted} | {100 * mfu:.1f}% |",
            flush=True,
        )
    print(
        f"# {backend} {name}: batch {batch}, {rounds} rounds, {flops / 1e9:.0f} GFLOP of "
        f"matmuls a step, bounds and peaks of an {gpu}",
        flush=True,
    )
    for config, (peak, weights, slots) in peaks.items():
        print(
            f"| memory | {backend} | {name} | {config} | {_mb(peak)} | {_mb(weights)} "
            f"| {_mb(slots)} |",
            flush=True,
        )
    for config, counts in censuses.items():
        if counts is None:
            print(f"# census {backend} {name} {config}: no optimized module dumped", flush=True)
            continue
        lowered, optimized = counts
        flops_by_dtype = ", ".join(
            f"{k} {v / 1e9:.1f}" for k, v in sorted(optimized["flops"].items())
        )
        print(
            f"| census | {backend} | {name} | {config} | {100 * lowered['half_share']:.1f}% "
            f"| {100 * optimized['half_share']:.1f}% | {flops_by_dtype} "
            f"| {optimized['converts']} ({optimized['convert MiB']:.1f} MiB) |",
            flush=True,
        )
    _print_profiles(name, profiles, steps)


def _kernels_of_an_epoch(keras, model, data, batch, config):
    """The GPU kernels of one traced epoch: (name, start_ns, duration_ns)."""
    import glob
    import tempfile

    from step_profile import _trace
    from step_profile import device_kernels

    if keras.backend.backend() == "torch":
        return _torch_kernels(keras, model, data, batch, config)
    with tempfile.TemporaryDirectory() as logdir:
        with _matmul_precision(keras, config == "O0 float32"):
            stop = _trace(keras, logdir)
            keras.Model.fit(model, *data, batch_size=batch, epochs=1, verbose=0)
            stop()
        paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        return device_kernels(paths[0]) if paths else []


def _torch_kernels(keras, model, data, batch, config):
    import torch

    with _matmul_precision(keras, config == "O0 float32"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            keras.Model.fit(model, *data, batch_size=batch, epochs=1, verbose=0)
    return [
        (e.name, 0, int(e.device_time_total * 1e3))  # microseconds -> ns
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]


def _print_profiles(name, profiles, steps):
    """Per configuration: milliseconds a step by kind of kernel, and the
    kernels that differ most between the profiled configurations (names
    with their numbers taken out, so that XLA's fusions line up)."""
    import re

    from step_profile import KINDS
    from step_profile import kind_of

    if not profiles:
        return
    grouped = {}
    for config, kernels in profiles.items():
        if not kernels:
            print(f"# profile {name} {config}: the trace holds no GPU kernels", flush=True)
            continue
        by_name = {}
        for kernel, _, ns in kernels:
            key = re.sub(r"\d+", "#", kernel)[:90]
            ms, count = by_name.get(key, (0.0, 0))
            by_name[key] = (ms + ns / 1e6 / steps, count + 1)
        grouped[config] = by_name
        kinds = dict.fromkeys(KINDS, 0.0)
        for key, (ms, _) in by_name.items():
            kinds[kind_of(key)] += ms
        cells = " | ".join(f"{kinds[k]:.2f}" for k in KINDS)
        print(
            f"| profile | {name} | {config} | {sum(kinds.values()):.2f} | {cells} "
            f"| {sum(c for _, c in by_name.values()) / steps:.0f} |",
            flush=True,
        )
    configs = list(grouped)
    keys = {k for g in grouped.values() for k in g}

    def spread(key):
        values = [grouped[c].get(key, (0.0, 0))[0] for c in configs]
        return max(values) - min(values)

    print(f"# kernels of {name} that differ most (ms a step, kernels a step): {configs}")
    for key in sorted(keys, key=spread, reverse=True)[:25]:
        cells = " | ".join(
            f"{grouped[c].get(key, (0.0, 0))[0]:.3f} ({grouped[c].get(key, (0, 0))[1] / steps:.0f})"
            for c in configs
        )
        print(f"| kernel | {name} | {key} | {cells} |", flush=True)


def _xla_dump_dir():
    """Where XLA dumps its modules (`--xla_dump_to` in XLA_FLAGS), or None."""
    import re

    match = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return match.group(1) if match else None


def _census_of_new_module(dump, seen):
    """The matmul census of the largest optimized module dumped since the
    last call (the train step: the compiled program the device runs)."""
    import glob

    from hlo_census import matmul_census

    paths = set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - seen
    seen |= paths
    if not paths:
        return None
    optimized = max(paths, key=os.path.getsize)
    lowered = optimized.replace("after_optimizations", "before_optimizations")
    lowered = glob.glob(lowered.split(".jit_")[0] + "*before_optimizations.txt") or [optimized]
    counts = []
    for path in (min(lowered, key=len), optimized):
        with open(path) as f:
            counts.append(matmul_census(f.read()))
    return tuple(counts)


SPEED_HEADER = (
    "| backend | model | configuration | step (ms) | speed-up over O0 (TF32 as set) "
    "| over O0 float32 (TF32 off) | speed report's bound: TF32 / off "
    "| model FLOP utilisation (of the dtype's peak) |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _nbytes(variables):
    import math
    import re

    def size(dtype):  # "bfloat16" -> 2 (NumPy knows no bfloat16)
        bits = re.search(r"\d+", str(dtype))
        return int(bits.group()) // 8 if bits else 1

    return sum(math.prod(v.shape) * size(v.dtype) for v in variables)


def _peak_bytes(keras):
    backend = keras.backend.backend()
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            return tf.config.experimental.get_memory_info("GPU:0")["peak"]
        if backend == "jax":
            import jax

            return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        import torch

        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    except (ValueError, RuntimeError, ImportError):
        return None  # no GPU


def _reset_peak(keras):
    """Resets the device's peak memory where the backend can (TensorFlow,
    PyTorch); the bytes in use now, or None."""
    backend = keras.backend.backend()
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats("GPU:0")
            return tf.config.experimental.get_memory_info("GPU:0")["current"]
        if backend == "torch":
            import torch

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                return torch.cuda.memory_allocated()
    except (ValueError, RuntimeError, ImportError):
        pass
    return None  # JAX's peak cannot be reset; no GPU


def run_memory(name, config, batch, tiny, jit_compile, predict):
    """One configuration's peak over a short fit, as a JSON line."""
    import gc

    import keras

    import keras_mp

    report = {"config": config}
    if predict and not config.startswith("keras"):
        # Predicted first, on a model of its own, gone before the one measured.
        level, dtype = (config.split() + ["float16"])[:2]
        fresh, _, make = _build(keras, name, tiny)
        summary = keras_mp.speed_report(
            fresh, make(batch)[0], level="O2" if level == "O0" else level, dtype=dtype
        ).summary
        report["predicted"] = summary["bytes"]["O0" if level == "O0" else level]
        del fresh, make, summary
        gc.collect()
    model, make = _compiled(keras, name, config, tiny, jit_compile)
    with _matmul_precision(keras, config == "O0 float32"):
        keras.Model.fit(model, *make(batch, 3), batch_size=batch, epochs=1, verbose=0)
    report["peak"] = _peak_bytes(keras)
    report["weights"] = _nbytes(model.weights)
    report["optimizer"] = _nbytes(model.optimizer.variables)
    print(json.dumps(report), flush=True)


def run_planned_memory(name, configs, batches, tiny, jit_compile, until=None):
    """JAX: what XLA plans for `fit`'s train step, compiled and not run
    (`keras_mp.tools.compiled_census.memory`): its temporaries at two
    batches, the state it holds (weights, optimizer), and the largest batch
    that fits the device, the temporaries taken as linear in the batch."""
    import jax
    import keras

    from keras_mp._src.tools import compiled_census

    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    print(
        "| planned | model | configuration | temporaries (MiB) at batch "
        + " / ".join(map(str, batches))
        + " | weights + optimizer (MiB) | largest batch (estimate) |",
        flush=True,
    )
    for config in configs:
        if until and time.time() > until:
            print(f"| planned | {name} | {config} | skipped: the lease's time | | |")
            continue
        try:
            model, make = _compiled(keras, name, config, tiny, jit_compile)
            held = [compiled_census.memory(model, *make(b)).held for b in batches]
            state = _nbytes(model.weights) + _nbytes(model.optimizer.variables)
            per = (held[-1] - held[0]) / (batches[-1] - batches[0])
            room = None if not limit or per <= 0 else limit - state - held[0]
            fits = "n/a" if room is None else int(room / per) + batches[0]
            print(
                f"| planned | {name} | {config} | " + " / ".join(_mb(h) for h in held)
                + f" | {_mb(state)} | {fits} |",
                flush=True,
            )  # fmt: skip
        except Exception as e:  # e.g. a configuration this backend cannot compile
            why = f"{type(e).__name__}: {str(e)[:80]}"
            print(f"| planned | {name} | {config} | failed: {why} | | |")
        _free_device_memory()
    print(f"# planned on {jax.devices()[0].device_kind}: bytes_limit {_mb(limit)} MiB", flush=True)


def _child(backend, *args):
    """Runs this script in a process of its own; (return code, stdout)."""
    out = subprocess.run(
        [sys.executable, __file__, *map(str, args)],
        env=dict(os.environ, KERAS_BACKEND=backend),
        capture_output=True,
        text=True,
    )
    return out.returncode, out.stdout


def _mb(n):
    return "n/a" if n is None else f"{n / 2**20:.4g}"


def memory_table(backends, models, configs, tiny, jit):
    print(
        "| backend | model | configuration | batch | peak (MiB) | weights | optimizer state "
        "| the rest (activations, gradients, workspace) | predicted: weights, optimizer, "
        "kept activations |\n|---|---|---|---|---|---|---|---|---|"
    )
    for backend in backends:
        for name in models:
            batch = BATCH[name] if not tiny else 4
            for config in configs:
                code, out = _child(
                    backend, "--memory-one", name, "--configs", config, "--batch", batch,
                    "--jit-compile", jit, *(["--tiny"] if tiny else []),
                )  # fmt: skip
                lines = [ln for ln in out.splitlines() if ln.startswith("{")]
                if code or not lines:
                    print(f"| {backend} | {name} | {config} | {batch} | failed (exit {code}) |")
                    continue
                r = json.loads(lines[-1])
                rest = None if r["peak"] is None else r["peak"] - r["weights"] - r["optimizer"]
                p = r.get("predicted")
                predicted = (
                    ""
                    if p is None
                    else ", ".join(_mb(p[k]) for k in ("weights", "optimizer", "activations"))
                )
                print(
                    f"| {backend} | {name} | {config} | {batch} | {_mb(r['peak'])} "
                    f"| {_mb(r['weights'])} | {_mb(r['optimizer'])} | {_mb(rest)} | {predicted} |",
                    flush=True,
                )


def max_batch_table(backends, models, tiny, jit, start, limit):
    print("| backend | model | configuration | largest batch that trains |\n|---|---|---|---|")
    for backend in backends:
        for name in models:
            for config in MAX_BATCH_CONFIGS:
                batch, largest = start, None
                while batch <= limit:
                    code, _ = _child(
                        backend, "--memory-one", name, "--configs", config, "--batch", batch,
                        "--jit-compile", jit, "--no-prediction", *(["--tiny"] if tiny else []),
                    )  # fmt: skip
                    if code:
                        break
                    largest, batch = batch, 2 * batch
                shown = (
                    "none"
                    if largest is None
                    else f"{largest}" + (f" (the limit, {limit})" if batch > limit else "")
                )
                print(f"| {backend} | {name} | {config} | {shown} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every backend, one process each")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--models", nargs="+", default=["resnet50", "gemma"], choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="default: 128 / 16 (tiny: 4)")
    parser.add_argument("--jit-compile", default="auto", choices=list(JIT_COMPILE))
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models (a check)")
    parser.add_argument("--memory", action="store_true", help="peak memory per configuration")
    parser.add_argument("--max-batch", action="store_true", help="largest batch per level")
    parser.add_argument("--start-batch", type=int, default=8, help="--max-batch's first try")
    parser.add_argument("--limit-batch", type=int, default=512, help="--max-batch's last try")
    parser.add_argument(
        "--lock", help="a file to lock while timing: processes sharing a GPU take turns"
    )
    parser.add_argument(
        "--profile", nargs="+", default=[], choices=CONFIGS, metavar="CONFIG",
        help="configurations whose kernels are profiled after the timing (one traced epoch)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-for",
        type=float,
        default=None,
        help="seconds from the start after which no more configurations are compiled",
    )
    parser.add_argument(
        "--planned-memory", nargs=2, type=int, metavar=("BATCH", "BATCH"), default=None,
        help="JAX: XLA's planned temporaries of the step at two batches, and the largest batch",
    )  # fmt: skip
    parser.add_argument("--memory-one", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--no-prediction", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.rounds, args.batch or 1, args.start_batch, args.limit_batch) < 1:
        parser.error("--rounds, --batch, --start-batch and --limit-batch must be positive")
    jit = JIT_COMPILE[args.jit_compile]
    tiny = ["--tiny"] if args.tiny else []
    backends = args.backends if args.all else [os.environ.get("KERAS_BACKEND", "tensorflow")]
    if args.memory_one:
        return run_memory(
            args.memory_one, args.configs[0], args.batch, args.tiny, jit, not args.no_prediction
        )
    if args.memory:
        return memory_table(backends, args.models, args.configs, args.tiny, args.jit_compile)
    if args.planned_memory:
        until = None if args.compile_for is None else time.time() + args.compile_for
        for name in args.models:
            configs = tuple(c for c in CONFIGS if c in args.configs)
            run_planned_memory(name, configs, sorted(args.planned_memory), args.tiny, jit, until)
        return
    if args.max_batch:
        return max_batch_table(
            backends, args.models, args.tiny, args.jit_compile, args.start_batch, args.limit_batch
        )
    print(SPEED_HEADER, flush=True)
    if args.all:
        for backend in args.backends:
            code, out = _child(
                backend, "--models", *args.models, "--configs", *args.configs, "--rounds",
                args.rounds, "--jit-compile", args.jit_compile, *tiny,
                *(["--batch", args.batch] if args.batch else []),
            )  # fmt: skip
            print("\n".join(ln for ln in out.splitlines() if ln.startswith(("|", "#"))))
            if code:
                print(f"# {backend}: exit {code}", flush=True)
        return
    configs = tuple(dict.fromkeys(args.configs))  # compiled in the order given
    until = None if args.compile_for is None else time.time() + args.compile_for
    for name in args.models:
        batch = args.batch or (4 if args.tiny else BATCH[name])
        run_speed(name, configs, args.rounds, batch, args.tiny, jit, args.lock, args.profile, until)
        _free_device_memory()


def _free_device_memory():
    """Lets the next model have the memory of the last (one process, several)."""
    import gc

    import keras

    keras.backend.clear_session()
    gc.collect()
    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
