"""`amp_level="auto"`: the level this machine trains the model fastest at."""

from keras_mp._src import backends
from keras_mp._src.backends import cpu_rates
from keras_mp._src.backends import gpu_peaks
from keras_mp._src.precision import speed_trace
from keras_mp._src.precision import step_time

# On a CPU, `auto` picks half precision where the model's step is predicted
# at least this many times faster than at O0 (`step_time.py`): the
# prediction's error (a BERT's step on JAX ran 0.98x O0's where its matmuls
# alone would give 1.4x) must not turn a predicted gain into a loss.
CPU_MIN_STEP_SPEEDUP = 1.1


def pick_auto_level(dtype=None, model=None, settings_for=None):
    """(level, dtype, reason) for `amp_level="auto"` on this machine.

    Args:
        dtype: the half dtype the user named (`amp_dtype=`), or None.
        model: the model being compiled, or None (nothing to predict).
        settings_for: `(level, half) -> AmpSettings` with the user's
            allow, deny and loss (compile's), for the model's prediction.
    """
    try:
        capability = backends.current.gpu_compute_capability()
    except Exception:  # No usable GPU runtime: treat as a CPU machine.
        capability = None
    flags = cpu_rates.cpu_flags()
    half = dtype or ("bfloat16" if capability is None else "float16")
    rates = step = None
    # Time and predict only where they decide: a CPU whose flags name no
    # native instructions for the dtype converts it to float32 anyway.
    computes = capability is not None or backends.current.computes_half_matmuls(half)
    if capability is None and computes and (not flags or cpu_rates.native(flags, half)):
        peaks = gpu_peaks.this_cpu(half=(half,))
        rates = {"float32": peaks.float32, half: peaks.matmul_rate(half)}
        step = _predicted(model, settings_for, half, peaks)
    elif capability is not None and capability >= (7, 0):
        step = _predicted(model, settings_for, half, gpu_peaks.this_machine())
    return auto_level_rule(capability, flags, backends.current.NAME, rates, dtype, computes, step)


def _predicted(model, settings_for, half, peaks):
    """The model's `step_time.Prediction` at O2 in `half`, or why there is none."""
    if model is None or settings_for is None:
        return None
    batch, words = step_time.synthetic_batch(model)
    if batch is None:
        return words
    if peaks.kind == "cpu" and not (peaks.launch_seconds("float32") and peaks.launch_seconds(half)):
        return "its launches could not be timed in this process"
    try:
        calls = speed_trace.trace(model, batch)
        return step_time.predict(
            model, calls, settings_for("O0", half), settings_for("O2", half), peaks, batch=words
        )
    except Exception as e:  # A model the symbolic pass cannot run: say so.
        return f"its step could not be traced ({type(e).__name__}: {e})"


def auto_level_rule(
    gpu_capability,
    cpu_flags,
    backend,
    cpu_matmul_rates=None,
    dtype=None,
    computes_half=True,
    step=None,
):
    """The rule of `amp_level="auto"`, from the machine's and the model's facts.

    - A GPU with tensor cores (compute capability >= 7.0): O2 in float16,
      with dynamic loss scaling; bfloat16 where the GPU has it natively (>= 8.0)
      needs no scaling, but float16 is the common baseline. Where the
      model's step is predicted slower at O2 (its kernel launches dominate
      it), O0; where they weigh on it, the reason says so.
    - A CPU: O2 in bfloat16 (or the `dtype` named) where its flags name
      native instructions for it (bfloat16: AVX512-BF16, AMX, Arm's BF16;
      float16: AVX512-FP16, AMX-FP16; no flags known: the timings alone)
      and the model's step is predicted at least `CPU_MIN_STEP_SPEEDUP`
      times faster than at O0 with this backend (`step_time.py`: its
      matmuls at the rates measured, its other work, casts and launches
      too; a 64-wide MLP, whose step is its launches, trains slower at O2
      whatever its matmul's rate), else O0.

    Args:
        gpu_capability: `(major, minor)` of the first GPU, or None.
        cpu_flags: set of /proc/cpuinfo flags (empty: not known).
        backend: "tensorflow", "jax" or "torch".
        cpu_matmul_rates: on a CPU, `{"float32": FLOP/s, dtype: FLOP/s}` of
            a matmul measured with `backend` (`cpu_rates.matmul_rate`); None
            where nothing was timed.
        dtype: the half dtype the user named, or None (bfloat16 on a CPU).
        computes_half: whether Keras's matmuls compute in that dtype with
            this backend on this device (PyTorch's CPU: float16 runs in
            float32).
        step: the model's `step_time.Prediction` at O2 on this device; a
            string, why none was made; None: no model.
    """
    if gpu_capability is not None:
        major, minor = gpu_capability
        if dtype == "bfloat16" and gpu_capability < (8, 0):
            return (
                "O0",
                "bfloat16",
                (
                    f"GPU without bfloat16 tensor cores (compute capability {major}.{minor}; "
                    "Ampere, 8.0, and later have them)"
                ),
            )
        if gpu_capability >= (7, 0):
            reason = f"GPU with tensor cores (compute capability {major}.{minor})"
            if isinstance(step, step_time.Prediction) and step.speedup < 1.0:
                # A step its launches dominate: O2's casts add launches and
                # its matmuls had little to save.
                return (
                    "O0",
                    "float16",
                    f"{reason}, but {step.explain()}: half precision would slow this "
                    "step (a larger batch or model hides the launches)",
                )
            if isinstance(step, step_time.Prediction) and step.at_level.launch_bound:
                reason += (
                    f"; but {step.explain()}: expect little speed-up from half precision "
                    "at this size (a larger batch or model hides them)"
                )
            return "O2", "float16", reason
        return "O0", "float16", f"GPU without tensor cores (compute capability {major}.{minor})"
    half = dtype or "bfloat16"
    native = cpu_rates.native(cpu_flags, half)
    names = {"bfloat16": "AVX512-BF16, AMX or BF16", "float16": "AVX512-FP16, AMX-FP16 or FP16"}
    if not cpu_flags:
        has = "this CPU's flags unknown"
    elif native:
        has = f"native {half} ({', '.join(native)})"
    else:
        has = f"no native {half} ({names.get(half, half)})"
    if not computes_half:
        return "O0", "float16", f"Keras's {backend} backend multiplies {half} in float32 on a CPU"
    if cpu_flags and not native:
        return "O0", "float16", f"CPU with {has}: {half} is converted to float32 to multiply here"
    if not cpu_matmul_rates:
        return "O0", "float16", f"CPU with {has}: nothing measured with {backend}"
    speedup = cpu_matmul_rates[half] / cpu_matmul_rates["float32"]
    measured = (
        f"a {half} matmul ran at {speedup:.2f}x float32's rate on this CPU with "
        f"{backend} (measured; {has})"
    )
    if not isinstance(step, step_time.Prediction):
        why = step or "no model was given to predict its step"
        return "O0", "float16", f"{measured}, but {why}: half precision is not known to pay"
    if step.speedup >= CPU_MIN_STEP_SPEEDUP:
        return "O2", half, f"{measured}; {step.explain()}"
    return (
        "O0",
        "float16",
        f"{measured}, but {step.explain()}; half precision needs "
        f"{CPU_MIN_STEP_SPEEDUP:.2f}x to pay",
    )


def float8_gemms_absent():
    """Why FP8 brings this machine no speed (a CPU, a GPU without FP8
    units), or None where its FP8 GEMMs may pay."""
    try:
        capability = backends.current.gpu_compute_capability()
    except Exception:  # No usable GPU runtime: a CPU machine.
        capability = None
    return float8_rule(capability, cpu_rates.cpu_flags(), backends.current.NAME)


def float8_rule(gpu_capability, cpu_flags, backend):
    """`float8_gemms_absent`'s rule, from the machine's facts."""
    if backend in ("jax", "torch"):
        how = "its FP8 GEMMs (FP8 operands into the dot) run without FP8 units"
    else:
        how = "Keras's float8 layers quantize to FP8 and multiply in bfloat16"
    if gpu_capability is None:
        native = ", ".join(sorted(set(cpu_flags) & {"avx512_bf16", "amx_bf16", "amx_fp8"}))
        has = f" (it has {native})" if native else ""
        return (
            f"this machine has no GPU and its CPU no FP8 matmul unit{has}: {how}, "
            "FP8 brings no speed here, slower than amp_dtype='bfloat16' and only noisier"
        )
    major, minor = gpu_capability
    if gpu_capability < (8, 9):
        return (
            f"this GPU (compute capability {major}.{minor}) has no FP8 tensor "
            f"cores (Ada, 8.9, and Hopper, 9.0, have): {how}, slower than "
            "amp_dtype='bfloat16'"
        )
    return None
