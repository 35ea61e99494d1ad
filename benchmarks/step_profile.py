"""Where a train step's time goes on the GPU, per configuration (JAX, TensorFlow).

The profile behind `amp_levels.py`'s speed-ups: for each configuration `fit`
runs a few steps under the backend's profiler, and the device's kernels are
summed per step by kind: matrix multiplications (cuBLAS, cuBLASLt and
XLA's own GEMMs), attention and convolution kernels (cuDNN), copies, and
everything else (XLA's elementwise and reduction fusions: casts, norms,
softmax, the optimizer's update). "idle" is the step's wall time in which
no kernel ran (launches, the host, the input pipeline).

Half precision halves the time of a kernel at best (float16 tensor cores
against TF32's; half the bytes of a memory-bound kernel), so a step runs
2x as fast as O0 only if every kernel halves and nothing is idle: the
table says which part of O0's step did not.

    KERAS_BACKEND=jax python benchmarks/step_profile.py --models transformer_large
    KERAS_BACKEND=tensorflow python benchmarks/step_profile.py --models transformer_large \\
        --jit-compile true

"O0 no TF32" is O0 with float32 matmuls computed in float32 (a GPU's TF32
tensor cores off): the baseline without TF32's own speed-up.
"""

import argparse
import contextlib
import glob
import re
import statistics
import tempfile

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
import amp_levels
from _common import JIT_COMPILE
from lso_overhead import _steady_state_timer

CONFIGS = ("O0", "O0 no TF32", "O2 float16", "keras mixed_float16", "O2 bfloat16")
KINDS = ("matmul", "attention", "conv", "copy", "other")
_KIND_PATTERNS = (
    ("attention", re.compile(r"sdpa|fmha|flash|attention", re.I)),
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|\bdot", re.I)),
    ("conv", re.compile(r"conv|cudnn|implicit_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


_DERIVED = {
    "XLA Modules",
    "XLA Ops",
    "XLA TraceMe",
    "TensorFlow Ops",
    "TensorFlow Name Scope",
    "Framework Name Scope",
    "Steps",
    "Source code",
}


def kind_of(kernel_name):
    """The kind of work a kernel's name says it does (see KINDS)."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(kernel_name):
            return kind
    return "other"


def _union_ns(intervals):
    """Nanoseconds covered by at least one of the (start, end) intervals."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def device_kernels(xplane_path):
    """(name, start_ns, duration_ns) of every kernel the trace's GPUs ran."""
    from jax.profiler import ProfileData

    kernels = []
    for plane in ProfileData.from_file(xplane_path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        # CUPTI's activity lines, one per stream; the profiler also derives
        # lines of ops and modules from them, which would count a kernel twice.
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or [line for line in lines if line.name not in _DERIVED]:
            kernels += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return kernels


def summarize(kernels, steps, step_s):
    """Milliseconds per step by kind, busy and idle; kernels per step.

    `kernels` are those of an epoch of `steps` steps; `step_s` is the wall
    time of one step.
    """
    per_kind = dict.fromkeys(KINDS, 0.0)
    for name, _, duration in kernels:
        per_kind[kind_of(name)] += duration / 1e6 / steps
    busy = _union_ns([(s, s + d) for _, s, d in kernels]) / 1e6 / steps
    step = step_s * 1e3
    return dict(
        per_kind, step=step, busy=busy, idle=max(step - busy, 0.0), kernels=len(kernels) / steps
    )


def _tf32_off(keras):
    """O0's float32 matmuls without TF32, for as long as the context lasts."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.default_matmul_precision("float32")
    import tensorflow as tf

    @contextlib.contextmanager
    def off():
        tf.config.experimental.enable_tensor_float_32_execution(False)
        try:
            yield
        finally:
            tf.config.experimental.enable_tensor_float_32_execution(True)

    return off()


def _trace(keras, logdir):
    if keras.backend.backend() == "jax":
        import jax

        jax.profiler.start_trace(logdir)
        return jax.profiler.stop_trace
    import tensorflow as tf

    tf.profiler.experimental.start(logdir)
    return tf.profiler.experimental.stop


def profile(model_name, configs, batch, steps, rounds, jit_compile):
    import keras
    import numpy as np

    import keras_mp

    rng = np.random.default_rng(0)
    rows = {}
    for config in configs:
        level = "O0" if config == "O0 no TF32" else config
        context = _tf32_off(keras) if config == "O0 no TF32" else contextlib.nullcontext()
        with context:
            model, shape = amp_levels._compiled(keras, keras_mp, model_name, level, jit_compile)
            x = rng.normal(size=(steps * batch,) + shape).astype("float32")
            y = rng.integers(0, 10, size=(steps * batch,))
            for _ in range(2):  # compiled, then warm
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
            # Seconds per step after the first two, `fit`'s set-up not counted.
            timer = _steady_state_timer(keras)(skip=2)
            per_step = []
            for _ in range(rounds):
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[timer])
                per_step.append(timer.per_step)
            with tempfile.TemporaryDirectory() as logdir:
                stop = _trace(keras, logdir)
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
                stop()
                paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
                kernels = device_kernels(paths[0]) if paths else []
        if not kernels:  # no GPU, or the profiler found no CUPTI (libcupti)
            print(f"# {model_name} {config}: the trace holds no GPU kernels", flush=True)
            continue
        rows[config] = summarize(kernels, steps, statistics.median(per_step))
        print(f"# {model_name} {config}: done", flush=True)
    return rows


def print_table(model_name, rows):
    if not rows:
        return
    columns = ("step", "idle", "busy") + KINDS
    print(
        f"\n{model_name}: milliseconds per step (the step untraced, median over rounds; "
        "the kinds from one traced epoch)\n"
    )
    print("| configuration | " + " | ".join(columns) + " | kernels |")
    print("|---|" + "---|" * (len(columns) + 1))
    for config, row in rows.items():
        cells = [f"{row[c]:.3f}" for c in columns]
        print(f"| {config} | " + " | ".join(cells) + f" | {row['kernels']:.0f} |")
    if "O0" not in rows:
        return
    base = rows["O0"]
    print("\nO0's time over each configuration's, per part (2.00 halves it):\n")
    parts = ("step", "idle") + KINDS
    print("| configuration | " + " | ".join(parts) + " |")
    print("|---|" + "---|" * len(parts))
    for config, row in rows.items():
        if config == "O0":
            continue
        cells = [f"{base[p] / row[p]:.2f}" if row[p] > 1e-3 else "-" for p in parts]
        print(f"| {config} | " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = amp_levels.MODELS + amp_levels.GPU_MODELS
    parser.add_argument("--models", nargs="+", default=["transformer_large"], choices=models)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=amp_levels.CONFIGS + ("O0 no TF32",),
        metavar="CONFIG",
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch (traced: one)")
    parser.add_argument("--rounds", type=int, default=5, help="timed epochs for the step time")
    parser.add_argument(
        "--jit-compile", default="auto", choices=list(JIT_COMPILE), help="TensorFlow"
    )
    args = parser.parse_args()
    if args.steps < 3:  # the timer skips the first two steps of an epoch
        parser.error(f"--steps must be at least 3, got {args.steps}")
    for name in ("batch", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive number, got {getattr(args, name)}")
    import keras

    if keras.backend.backend() not in ("jax", "tensorflow"):
        parser.error("the profile is JAX's or TensorFlow's (KERAS_BACKEND=jax|tensorflow)")
    jit_compile = JIT_COMPILE[args.jit_compile]
    for model_name in args.models:
        rows = profile(model_name, args.configs, args.batch, args.steps, args.rounds, jit_compile)
        print_table(model_name, rows)


if __name__ == "__main__":
    main()
