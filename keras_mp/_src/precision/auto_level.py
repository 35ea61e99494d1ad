"""`amp_level="auto"`: the level this machine trains fastest at."""

from keras_mp._src import backends


def pick_auto_level():
    """(level, dtype, reason) for `amp_level="auto"` on this machine."""
    try:
        capability = backends.current.gpu_compute_capability()
    except Exception:  # No usable GPU runtime: treat as a CPU machine.
        capability = None
    return auto_level_rule(capability, _cpu_flags(), backends.current.NAME)


def auto_level_rule(gpu_capability, cpu_flags, backend):
    """The rule of `amp_level="auto"`, from the machine's facts.

    - A GPU with tensor cores (compute capability >= 7.0): O2 in float16,
      with dynamic loss scaling; bfloat16 where the GPU has it natively (>= 8.0)
      needs no scaling, but float16 is the common baseline.
    - A CPU with native bfloat16 instructions (AVX512_BF16 or AMX) on the
      TensorFlow backend: O2 in bfloat16, which measured faster there on
      dense and convolutional models (`benchmarks/README.md`).
    - Otherwise O0: on CPUs, PyTorch's bfloat16 attention and JAX's half
      precision measured slower than float32.

    Args:
        gpu_capability: `(major, minor)` of the first GPU, or None.
        cpu_flags: set of /proc/cpuinfo flags.
        backend: "tensorflow", "jax" or "torch".
    """
    if gpu_capability is not None:
        major, minor = gpu_capability
        if gpu_capability >= (7, 0):
            return "O2", "float16", f"GPU with tensor cores (compute capability {major}.{minor})"
        return "O0", "float16", f"GPU without tensor cores (compute capability {major}.{minor})"
    native = sorted(set(cpu_flags) & {"avx512_bf16", "amx_bf16"})
    if backend == "tensorflow" and native:
        return "O2", "bfloat16", f"CPU with native bfloat16 ({', '.join(native)}) on {backend}"
    return "O0", "float16", f"half precision is slower than float32 on this CPU with {backend}"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def float8_gemms_absent():
    """Why this machine computes no FP8 matmul for Keras's float8 layers
    (their quantize-dequantize then runs around bfloat16 matmuls: FP8's
    rounding without its speed), or None where it may."""
    try:
        capability = backends.current.gpu_compute_capability()
    except Exception:  # No usable GPU runtime: a CPU machine.
        capability = None
    return float8_rule(capability, _cpu_flags(), backends.current.NAME)


def float8_rule(gpu_capability, cpu_flags, backend):
    """`float8_gemms_absent`'s rule, from the machine's facts."""
    if gpu_capability is None:
        native = ", ".join(sorted(set(cpu_flags) & {"avx512_bf16", "amx_bf16", "amx_fp8"}))
        has = f" (it has {native})" if native else ""
        return (
            f"this machine has no GPU and its CPU no FP8 matmul unit{has}: "
            "Keras's float8 layers quantize to FP8 and multiply in bfloat16, "
            "slower than amp_dtype='bfloat16' and only noisier"
        )
    major, minor = gpu_capability
    if gpu_capability < (8, 9):
        return (
            f"this GPU (compute capability {major}.{minor}) has no FP8 tensor "
            "cores (Ada, 8.9, and Hopper, 9.0, have): its FP8 layers multiply "
            "in bfloat16, slower than amp_dtype='bfloat16'"
        )
    if backend == "jax":
        return (
            "on JAX, XLA did not rewrite Keras's float8 layers into FP8 GEMMs "
            "on an H100 (benchmarks/README.md): their matmuls ran in bfloat16, "
            "slower than amp_dtype='bfloat16'"
        )
    return None
