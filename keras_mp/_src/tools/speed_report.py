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
fuses, and launch and host costs are only counted for the warning. The GPU
issue compares it with the clock (`benchmarks/README.md`).
"""

import dataclasses

from keras_mp._src.backends import gpu_peaks
from keras_mp._src.optimizer import low_precision_state
from keras_mp._src.precision import amp_settings
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost
from keras_mp._src.precision.float8 import Float8Recipe
from keras_mp._src.precision.levels import FLOAT8
from keras_mp._src.precision.levels import FLOAT8_LEVELS
from keras_mp._src.precision.levels import HALF_DTYPES
from keras_mp._src.precision.policies import check_model
from keras_mp._src.tools import speed_model
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
        keep_batchnorm_fp32, allow, deny: as in `apply_amp`.
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
    amp = amp_settings.for_layers(level, dtype, keep_batchnorm_fp32, allow, deny)
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
    # Forward and two backward kernels a layer, one a cast, one update a variable.
    launches = sum(3 + a.casts for a in at_level.values() if a.flops or a.moved)
    launches += len(model.trainable_variables)
    launch_seconds = launches * gpu_peaks.LAUNCH_SECONDS
    summary = _summary(
        level, dtype, peaks, at_level, memory, times, launches, launch_seconds, replicas
    )
    summary["advice"] = _advice(at_level, peaks, times[level], launch_seconds, amp.half)
    summary["advice"] += _float8_advice(model, calls, amp, at_level, peaks)
    summary["advice"] = [text for _, text in sorted(summary["advice"], key=lambda e: -e[0])][:8]
    rows = [_row(a, peaks) for a in at_level.values() if a.flops or a.casts]
    text = _render(rows, summary, level, dtype)
    report = SpeedReport(text, rows, summary)
    if print_fn is not None:
        print_fn(report.text)
    return report


def _summary(level, dtype, peaks, accounts, memory, times, launches, launch_s, replicas):
    flops = sum(a.step_flops for a in accounts.values())
    half = sum(a.step_flops for a in accounts.values() if a.dtype in HALF_DTYPES)
    share = half / flops if flops else 0.0
    fp8 = sum(a.step_flops for a in accounts.values() if a.matmul == FLOAT8)
    fp8_share = fp8 / flops if flops else 0.0
    in_fp8 = ""
    if fp8:
        in_fp8 = f", {fp8_share:.0%} in FP8"
        if peaks.float8 is None:
            where = peaks.name if peaks.kind == "cpu" else f"the {peaks.name}"
            in_fp8 += f" (no FP8 matmul unit on {where}: bfloat16's rate)"
    bound = times["O0, TF32"] / times[level]
    strict = times["O0, float32"] / times[level]
    launch_bound = peaks.kind == "gpu" and launch_s > times[level]
    if peaks.kind == "cpu":
        matmul_dtype = "bfloat16" if dtype == FLOAT8 else dtype
        rate = peaks.matmul_rate(matmul_dtype) / peaks.float32
        verdict = (
            f"{level} {dtype} on {peaks.name}: a {matmul_dtype} matmul ran at {rate:.2f}x "
            f"float32's rate here; at most {bound:.2f}x the float32 step; {share:.0%} of "
            f"the matmul FLOPs in half{in_fp8}."
        )
        if not peaks.native_half(matmul_dtype):
            verdict += (
                f" This CPU has no native {matmul_dtype} instructions: it converts to "
                "float32 to multiply, so expect little or no speed-up"
                + (
                    "; it has native bfloat16 (amp_dtype='bfloat16')."
                    if "bfloat16" in (peaks.native or ())
                    else "."
                )
            )
    elif launch_bound:
        verdict = (
            f"{level} {dtype} on an {peaks.name}: expect no speed-up: a step is "
            f"{launches} kernel launches (~{launch_s * 1e3:.2f} ms) for "
            f"~{times[level] * 1e3:.3f} ms of work, too small for them to be "
            f"hidden (a larger batch or model); its work alone would give at most "
            f"{bound:.1f}x over float32 with TF32 on ({strict:.1f}x with it off)."
        )
    else:
        verdict = (
            f"{level} {dtype} on an {peaks.name}: at most {bound:.1f}x the float32 "
            f"step with TF32 on (TensorFlow's default there), {strict:.1f}x with "
            f"TF32 off; {share:.0%} of the matmul FLOPs in half{in_fp8}."
        )
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
        "verdict": verdict,
    }


# Float32 rows that `allow=` overrides: the user's composite layers at O2 in
# float16, what O1's allow-list leaves out.
_LIFTABLE = ("allow= for half", "not on the allow-list")


def _advice(accounts, peaks, step, launch_s, dtype):
    """What to change, ranked by the seconds a step would save; the same
    finding at several layers of one class is one line."""
    found = {}  # (what, class) -> [seconds, layer names, text]

    def add(key, seconds, layer, text):
        entry = found.setdefault(key, [0.0, [], text])
        entry[0] += seconds
        entry[1].append(f"`{_name(layer)}`")

    for a in accounts.values():
        kind = type(a.layer).__name__
        bad = speed_trace.misaligned(a.dims)
        if bad and a.dtype in HALF_DTYPES and a.flops and peaks.kind == "gpu":
            now = a.step_flops / peaks.matmul_rate(a.dtype, aligned=False)
            padded = a.step_flops / peaks.matmul_rate(a.dtype)
            what = ", ".join(f"{k}={v} -> {-(-v // 8) * 8}" for k, v in bad)
            add(
                ("pad", kind, what),
                now - padded,
                a.layer,
                f"pad {what} ({kind}): tensor cores need multiples of 8",
            )
        if a.dtype == "float32" and a.flops:
            in_half = a.step_flops * (
                1 / peaks.matmul_rate("float32", tf32=True) - 1 / peaks.matmul_rate(dtype)
            )
            if any(t in a.reason for t in _LIFTABLE):
                add(
                    ("allow", kind),
                    in_half,
                    a.layer,
                    f"{kind} computes in float32 ({a.reason}): `allow=[...]` lifts it",
                )
        if a.cast_bytes:
            add(
                ("casts", kind, a.dtype),
                a.cast_bytes / peaks.bandwidth,
                a.layer,
                f"casts in and out of {kind} ({a.dtype})",
            )
    advice = [(seconds, text, names) for seconds, names, text in found.values()]
    if peaks.kind == "gpu" and launch_s > step:
        advice.append(
            (launch_s - step, "a larger batch: the step is bound by its kernel launches", [])
        )
    lines = []
    for seconds, text, names in advice:
        where = ""
        if names:
            where = (
                " at "
                + ", ".join(names[:3])
                + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            )
        lines.append((seconds, f"{text}{where} (~{seconds * 1e6:.1f} us a step)"))
    return lines


def _float8_advice(model, calls, amp, accounts, peaks):
    """Where FP8 would help on this GPU, as `(seconds, text)`: at a half
    level, `amp_dtype="float8"`; at the float8 level, the layers its rules
    keep in bfloat16 (first, output, misaligned)."""
    if peaks.float8 is None or amp.name not in FLOAT8_LEVELS:
        return []
    if amp.float8 is None:
        as_fp8 = dataclasses.replace(amp, half="bfloat16", float8=Float8Recipe())
        candidates = step_cost.accounts_at(model, calls, as_fp8)
    else:
        allowed = tuple(a.layer for a in accounts.values() if a.matmul != FLOAT8 and a.flops)
        as_fp8 = dataclasses.replace(amp, allow=amp.allow + allowed)
        candidates = step_cost.accounts_at(model, calls, as_fp8)
    saved, names, kinds = 0.0, [], set()
    for key, a in candidates.items():
        now = accounts.get(key)
        if a.matmul != FLOAT8 or now is None or now.matmul == FLOAT8:
            continue
        saved += step_cost.layer_seconds(now, peaks, True) - step_cost.layer_seconds(a, peaks, True)
        saved -= (a.cast_bytes - now.cast_bytes) / peaks.bandwidth
        names.append(f"`{_name(a.layer)}`")
        kinds.add(type(a.layer).__name__)
    if saved <= 0:
        return []
    where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if amp.float8 is None:
        text = f"amp_dtype='float8': FP8 matmuls at {where} ({', '.join(sorted(kinds))})"
    else:
        text = f"allow=[...] (first or output layer) or padding to 16 puts {where} in FP8"
    return [(saved, f"{text} (~{saved * 1e6:.1f} us a step)")]


def _name(layer):
    return layer.path if getattr(layer, "path", None) else layer.name


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
        "layer": _name(a.layer),
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
