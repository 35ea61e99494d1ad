"""`speed_report`: why a model is, or is not, faster in half precision.

"I turned mixed precision on and nothing got faster" has a few causes that
keras_mp can see without a GPU, since it knows each layer's precision at
every level: matmuls that stay in float32, shapes the tensor cores cannot
take (16-bit: multiples of 8), casts between layers of different precision,
a step too small for its kernel launches to be hidden, and TF32, which
TensorFlow turns on for float32 matmuls on Ampere and later (so float32 is
already fast there). The report computes, from one symbolic forward pass
(`speed_trace.py`) and the rules (`policies.decide_all`, what `apply_amp`
would set):

- per layer: the FLOPs of its matmuls, convolutions, attention and
  recurrences (forward and backward: three times the forward's), the dtype
  they run in at the level, whether their shapes suit tensor cores, and the
  casts at its boundaries (count, bytes per step, forward and backward);
- for the model: the share of FLOPs in half; the bytes of weights,
  optimizer state (slots, master copies; per replica with
  `shard_optimizer_state`) and activations kept for the backward pass, at
  O0 and at the level; the kernels a step launches;
- an upper bound on the step's speed-up on a named GPU (`gpu_peaks.py`): a
  roofline per layer, its matmul FLOPs at the tensor-core rate of their
  dtype against the bytes it moves at the memory bandwidth, summed, with
  the optimizer's update as bytes; O0 with TF32 on and off;
- what to change, ranked by the time it would save.

It is a bound, not a measurement: peaks are never reached, elementwise work
fuses, and launch and host costs are only counted for the warning (launches
at 5 us on a GPU, at the cost one measured with this backend on a CPU),
which leads the verdict where they exceed the step's work. On a CPU the
report also predicts the step's speed-up, launches and elementwise work
counted (`precision/step_time.py`, what `amp_level="auto"` decides from).
`benchmarks/README.md` compares both with the clock.
"""

import dataclasses

from keras_mp._src.backends import gpu_peaks
from keras_mp._src.optimizer import low_precision_state
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost
from keras_mp._src.precision import step_time
from keras_mp._src.precision.levels import FLOAT8
from keras_mp._src.precision.levels import HALF_DTYPES
from keras_mp._src.precision.policies import check_model
from keras_mp._src.tools import speed_model
from keras_mp._src.tools import speed_verdict
from keras_mp._src.tools import table


@dataclasses.dataclass(frozen=True, repr=False)
class SpeedReport(table.Report):
    """`speed_report`'s table (`print(report)`), its `.rows` (one dict per
    layer with work or casts) and `.summary` (a dict for the model);
    `.verdict` is the one line."""

    summary: dict = dataclasses.field(default_factory=dict)

    @property
    def verdict(self):
        return self.summary["verdict"]


def speed_report(
    model,
    x,
    level="O2",
    dtype="float16",
    device=None,
    slots=None,
    replicas=1,
    shard_optimizer_state=False,
    moment_dtypes="model",
    keep_batchnorm_fp32=None,
    allow=None,
    deny=None,
    print_fn=None,
    gpu=None,
    float8_recipe=None,
):
    """Predicts, on any machine, what a precision level does to a step's speed.

    Args:
        model: a Keras model (built, or built by the trace); it is not changed.
        x: one batch of inputs (arrays, or anything with `.shape` and `.dtype`).
        level: `"O1"`, `"O2"` or `"O3"`, as in `apply_amp`.
        dtype: `"float16"`, `"bfloat16"`, or `"float8"` (O2, O3: the matmuls
            `apply_amp` would put in FP8 at FP8's rate where the GPU has FP8
            tensor cores, H100, H200, L4; bfloat16's elsewhere).
        device: what to predict for: None, this machine (its GPU, with the
            H100's peaks under its own name where `gpu_peaks.GPUS` does not
            name it, else its CPU); `"cpu"`, this machine's CPU with this
            backend, its matmul rates measured (a few seconds at most, once
            per process); a `gpu_peaks.Peaks`; or a GPU to plan for,
            `"H100"`, `"H200"`, `"A100"`, `"L4"`, `"T4"`.
        slots: optimizer slots per trainable weight (Adam 2, SGD with momentum
            1); None: from the model's compiled optimizer, else 2.
        replicas: data-parallel replicas (for `shard_optimizer_state`).
        shard_optimizer_state: master copies and slots split over `replicas`.
        moment_dtypes: Adam's moments as `LossScaleOptimizer(moment_dtypes=...)`
            keeps them (`"float8"`, a pair, or None for float32); by default
            those of the model's compiled optimizer.
        keep_batchnorm_fp32, allow, deny, float8_recipe: as in `apply_amp`
            (the recipe's `small_gemm` keeps small matmuls out of FP8).
        print_fn: optional callable given the text (e.g. `print`).
        gpu: the older name of `device` (a GPU's name).

    Returns:
        A `SpeedReport`.
    """
    check_model(model)
    if gpu is not None:
        if device is not None:
            raise ValueError(
                "`gpu` is the older name of `device`: pass one of them. "
                f"Received: device={device!r}, gpu={gpu!r}"
            )
        peaks = gpu_peaks.peaks_of(gpu, "gpu")
    else:
        peaks = gpu_peaks.peaks_of(device)
    amp = amp_settings.for_layers(level, dtype, keep_batchnorm_fp32, allow, deny, float8_recipe)
    reference = amp_settings.for_layers("O0", amp.half)
    calls = speed_trace.trace(model, x)
    slots = speed_model.slots_of(model) if slots is None else slots
    if moment_dtypes == "model":
        moment_dtypes = speed_model.moments_of(model)
    moment_dtypes = low_precision_state.check_argument(moment_dtypes)
    at_level = step_cost.accounts_at(model, calls, amp)
    at_o0 = step_cost.accounts_at(model, calls, reference)
    memory = {
        name: speed_model.memory(
            model,
            amp_,
            slots,
            replicas,
            shard_optimizer_state,
            accounts,
            moment_dtypes if amp_ is amp else None,  # O0: float32 Adam
        )
        for name, amp_, accounts in (("O0", reference, at_o0), (level, amp, at_level))
    }
    times = {
        "O0, TF32": speed_model.step_seconds(at_o0, memory["O0"], peaks, tf32=True),
        "O0, float32": speed_model.step_seconds(at_o0, memory["O0"], peaks, tf32=False),
        level: speed_model.step_seconds(at_level, memory[level], peaks, tf32=True),
    }
    # Forward and two backward kernels a layer, one a cast, one update a
    # variable; at what one costs on the GPU, or this CPU with this backend
    # (its proxy's step: not known for a CPU's `Peaks` of one's own).
    launches = step_time.launches(model, at_level)
    half = "bfloat16" if amp.float8 is not None else amp.half
    each = peaks.launch_seconds(half if amp.level.computes_in_half else "float32")
    launch_seconds = launches * (each or 0.0)
    predicted = None
    if peaks.kind == "cpu" and each:
        # The whole step, launches and elementwise work too (`step_time.py`).
        predicted = step_time.predict(model, calls, reference, amp, peaks, slots).speedup
    summary = _summary(
        level, dtype, peaks, at_level, memory, times, launches, launch_seconds, replicas
    )
    summary["predicted_speedup"] = predicted
    summary["verdict"] = speed_verdict.verdict(summary, peaks, each)
    summary["advice"] = speed_verdict.advice(
        at_level, peaks, times[level], launch_seconds, amp.half
    )
    summary["advice"] += speed_verdict.float8_advice(model, calls, amp, at_level, peaks)
    summary["advice"] = [text for _, text in sorted(summary["advice"], key=lambda e: -e[0])][:8]
    rows = [_row(a, peaks) for a in at_level.values() if a.flops or a.casts]
    text = _render(rows, summary, level, dtype)
    report = SpeedReport(text, rows, summary)
    if print_fn is not None:
        print_fn(report.text)
    return report


def _summary(level, dtype, peaks, accounts, memory, times, launches, launch_s, replicas):
    """The numbers of the report; `speed_verdict` says what they mean."""
    flops = sum(a.step_flops for a in accounts.values())
    half = sum(a.step_flops for a in accounts.values() if a.dtype in HALF_DTYPES)
    share = half / flops if flops else 0.0
    fp8 = sum(a.step_flops for a in accounts.values() if a.matmul == FLOAT8)
    fp8_share = fp8 / flops if flops else 0.0
    bound = times["O0, TF32"] / times[level]
    strict = times["O0, float32"] / times[level]
    launch_bound = launch_s > times[level]
    return {
        "level": level,
        "dtype": dtype,
        "gpu": peaks.name,
        "flops_per_step": flops,
        "half_flop_share": share,
        "float8_flop_share": fp8_share,
        "bytes": memory,
        "replicas": replicas,
        "step_seconds": times,
        "speedup_bound_tf32": bound,
        "speedup_bound_float32": strict,
        "device_kind": peaks.kind,
        "kernel_launches": launches,
        "launch_seconds": launch_s,
        "launch_bound": launch_bound,
    }


def _row(a, peaks):
    bad = speed_trace.misaligned(a.dims)
    if not a.flops:
        cores = "-"
    elif peaks.kind == "cpu":
        cores = "n/a (CPU)"
    elif a.matmul == FLOAT8:
        cores = "yes (FP8)"
    elif a.dtype not in HALF_DTYPES:
        cores = "float32"
    elif bad:
        cores = "no: " + ", ".join(f"{k}={v}" for k, v in bad)
    else:
        cores = "yes"
    return {
        "layer": speed_verdict.layer_name(a.layer),
        "class": type(a.layer).__name__,
        "dtype": a.matmul or a.dtype,
        "flops": a.step_flops,
        "tensor_cores": cores,
        "casts": a.casts,
        "cast_bytes": a.cast_bytes,
    }


def _render(rows, summary, level, dtype):
    cells = [
        [
            r["layer"],
            r["class"],
            r["dtype"],
            f"{r['flops'] / 1e9:.4g}",
            r["tensor_cores"],
            str(r["casts"]),
            f"{r['cast_bytes'] / 1e6:.3g}",
        ]
        for r in rows
    ]
    headers = ("Layer", "Class", "Dtype", "GFLOP/step", "Tensor cores", "Casts", "Cast MB")
    lines = table.render(headers, cells)
    b = summary["bytes"]
    lines += [
        "",
        f"Matmul work in half: {summary['half_flop_share']:.0%}"
        + (f" ({summary['float8_flop_share']:.0%} in FP8)" if summary["float8_flop_share"] else "")
        + " of "
        f"{summary['flops_per_step'] / 1e9:.4g} GFLOP a step (forward and backward).",
        f"Bytes, O0 -> {level}: "
        + ", ".join(
            f"{what} {_mb(b['O0'][key])} -> {_mb(b[level][key])}"
            for what, key in (
                ("weights", "weights"),
                ("optimizer state", "optimizer"),
                ("activations kept", "activations"),
            )
        )
        + ".",
        f"Kernel launches a step: ~{summary['kernel_launches']}.",
        summary["verdict"],
    ]
    if summary["advice"]:
        lines += ["", "What to change, by the time it would save:"]
        lines += [f"  {i + 1}. {text}" for i, text in enumerate(summary["advice"])]
    return "\n".join(lines)


def _mb(n):
    return f"{n / 1e6:.3g} MB"
