"""What the speed report's numbers mean: the verdict (`verdict`: the bound,
or first that the step's launches dominate it, on a GPU and on a CPU, where
the predicted speed-up comes with it) and what to change, ranked by the
time it would save (`advice`, `float8_advice`)."""

import dataclasses

from keras_mp._src.precision import float8
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_cost
from keras_mp._src.precision.float8 import Float8Recipe
from keras_mp._src.precision.levels import FLOAT8
from keras_mp._src.precision.levels import FLOAT8_LEVELS
from keras_mp._src.precision.levels import HALF_DTYPES


def verdict(summary, peaks, each):
    """The one line: the bound, or where launches dominate the step, that
    (with the prediction on a CPU) first."""
    level, dtype = summary["level"], summary["dtype"]
    bound, strict = summary["speedup_bound_tf32"], summary["speedup_bound_float32"]
    share = summary["half_flop_share"]
    in_fp8 = ""
    if summary["float8_flop_share"]:
        in_fp8 = f", {summary['float8_flop_share']:.0%} in FP8"
        if peaks.float8 is None:
            where = peaks.name if peaks.kind == "cpu" else f"the {peaks.name}"
            in_fp8 += f" (no FP8 matmul unit on {where}: bfloat16's rate)"
    launches, launch_s = summary["kernel_launches"], summary["launch_seconds"]
    work = summary["step_seconds"][level]
    predicted = summary["predicted_speedup"]
    # Launches dominate the step: the prediction says whether the level
    # still gains a little or loses.
    expect = (
        "expect no speed-up" if predicted is None or predicted < 1.0 else "expect little speed-up"
    )
    if peaks.kind == "cpu":
        matmul_dtype = "bfloat16" if dtype == FLOAT8 else dtype
        rate = peaks.matmul_rate(matmul_dtype) / peaks.float32
        measured = f"a {matmul_dtype} matmul ran at {rate:.2f}x float32's rate here"
        if summary["launch_bound"]:
            verdict = (
                f"{level} {dtype} on {peaks.name}: {expect} (predicted "
                f"{predicted:.2f}x the float32 step): a step is {launches} launches "
                f"(~{launch_s * 1e3:.2f} ms at {each * 1e6:.3g} us each with this "
                f"backend) for ~{work * 1e3:.3f} ms of modelled work, too small for "
                f"half precision to pay (a larger batch or model); {measured}, and its "
                f"work alone would give at most {bound:.2f}x; {share:.0%} of the matmul "
                f"FLOPs in half{in_fp8}."
            )
        else:
            verdict = (
                f"{level} {dtype} on {peaks.name}: {measured}; at most {bound:.2f}x the "
                f"float32 step"
                + (
                    f" (predicted {predicted:.2f}x, its launches and elementwise work counted)"
                    if predicted is not None
                    else ""
                )
                + f"; {share:.0%} of the matmul FLOPs in half{in_fp8}."
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
        return verdict
    if summary["launch_bound"]:
        return (
            f"{level} {dtype} on an {peaks.name}: {expect}: a step is "
            f"{launches} kernel launches (~{launch_s * 1e3:.2f} ms) for "
            f"~{work * 1e3:.3f} ms of work, too small for them to be "
            f"hidden (a larger batch or model); its work alone would give at most "
            f"{bound:.1f}x over float32 with TF32 on ({strict:.1f}x with it off)."
        )
    return (
        f"{level} {dtype} on an {peaks.name}: at most {bound:.1f}x the float32 "
        f"step with TF32 on (TensorFlow's default there), {strict:.1f}x with "
        f"TF32 off; {share:.0%} of the matmul FLOPs in half{in_fp8}."
    )


# Float32 rows that `allow=` overrides: the user's composite layers at O2 in
# float16, what O1's allow-list leaves out.
_LIFTABLE = ("allow= for half", "not on the allow-list")


def advice(accounts, peaks, step, launch_s, dtype):
    """What to change, ranked by the seconds a step would save; the same
    finding at several layers of one class is one line."""
    found = {}  # (what, class) -> [seconds, layer names, text]

    def add(key, seconds, layer, text):
        entry = found.setdefault(key, [0.0, [], text])
        entry[0] += seconds
        entry[1].append(f"`{layer_name(layer)}`")

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
    if launch_s > step:
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


def float8_advice(model, calls, amp, accounts, peaks):
    """Where FP8 would help on this GPU, as `(seconds, text)`: at a half
    level, `amp_dtype="float8"`; at the float8 level, the layers its rules
    keep in bfloat16 (first, output, misaligned)."""
    if peaks.float8 is None or amp.name not in FLOAT8_LEVELS:
        return []
    if amp.float8 is None:
        as_fp8 = dataclasses.replace(amp, half="bfloat16", float8=Float8Recipe())
        candidates = step_cost.accounts_at(model, calls, as_fp8)
    else:
        allowed = tuple(
            a.layer
            for a in accounts.values()
            if a.matmul != FLOAT8 and a.flops and not _too_small(a.layer, amp.float8)
        )
        as_fp8 = dataclasses.replace(amp, allow=amp.allow + allowed)
        candidates = step_cost.accounts_at(model, calls, as_fp8)
    saved, names, kinds = 0.0, [], set()
    for key, a in candidates.items():
        now = accounts.get(key)
        if a.matmul != FLOAT8 or now is None or now.matmul == FLOAT8:
            continue
        saved += step_cost.layer_seconds(now, peaks, True) - step_cost.layer_seconds(a, peaks, True)
        saved -= (a.cast_bytes - now.cast_bytes) / peaks.bandwidth
        names.append(f"`{layer_name(a.layer)}`")
        kinds.add(type(a.layer).__name__)
    if saved <= 0:
        return []
    where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if amp.float8 is None:
        text = f"amp_dtype='float8': FP8 matmuls at {where} ({', '.join(sorted(kinds))})"
    else:
        text = f"allow=[...] (first or output layer) or padding to 16 puts {where} in FP8"
    return [(saved, f"{text} (~{saved * 1e6:.1f} us a step)")]


def _too_small(layer, recipe):
    """A Dense or EinsumDense the recipe keeps in bfloat16 for its size."""
    return float8.has_float8_path(layer) and float8.too_small(layer, recipe) is not None


def layer_name(layer):
    return layer.path if getattr(layer, "path", None) else layer.name
