"""Peak rates of the devices the speed report and `amp_level="auto"`
predict for, as data: the GPUs' from their data sheets, this machine's
CPU measured (`this_cpu`).

Dense (not sparse) tensor-core rates from NVIDIA's data sheets, in FLOP/s,
and memory bandwidth in bytes/s. A rate of None means the GPU has no such
unit: T4 (Turing) has no bfloat16 and no TF32 tensor cores, so bfloat16
matmuls run at its float32 rate there and TF32 is float32.

`float8`: FP8 tensor cores (Hopper, Ada); None where there are none (A100,
T4): an FP8 layer's matmul is a bfloat16 one there (XLA converts its FP8
operands; PyTorch multiplies them dequantized, `_scaled_mm` having no
kernel there).

`HALF_CUDA_CORE_FACTOR`: a 16-bit matmul whose dimensions are not multiples
of 8 cannot use the tensor cores' fast path; the report counts it at twice
the float32 (CUDA-core) rate, what half arithmetic reaches without them.
`LAUNCH_SECONDS`: the host and launch cost of one kernel, hidden only when
a step's kernels run longer than it takes to launch them.

`O0_ATTAINED`: the bound is a bound on the speed-up, so it takes the
level's half matmuls at their peak and float32 matmuls (O0's, and those
the level keeps) at a fraction of their peak below what measured steps
reached: on an H100 (`benchmarks/README.md`) O0's step ran TF32 matmuls at
23 % of TF32's peak on the Gemma (matmul-bound; bfloat16's reached 29 % of
theirs) and 12 % on ResNet50 (most of its step outside matmuls), strict
float32 at 50 % and 29 %: TF32 counts at 20 %, strict float32 at 25 %.

A CPU (`this_cpu`) has no peak table: its rates are those `cpu_rates.py`
measured with this process's backend, and a half dtype's matmul counts at
no less than float32's rate for the bound (an emulated dtype converts and
multiplies in float32). O0's float32 matmuls count at half the timed rate:
on a 2-core AMD EPYC without AVX512-BF16, JAX's steps of a BERT, a GPT-2
and a ResNet50 ran 1.09-1.16x faster in bfloat16 than in float32 where a
bfloat16 matmul alone timed 0.55x float32's (`benchmarks/README.md`): the
step's other work, which halves its bytes, is more than its matmuls.
"""

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Peaks:
    name: str
    float16: float
    bfloat16: object  # None: no bfloat16 tensor cores
    tf32: object  # None: no TF32 tensor cores
    float32: float
    bandwidth: float  # bytes/s
    float8: object = None  # None: no FP8 tensor cores
    kind: str = "gpu"  # or "cpu": measured rates, no tensor cores
    # A CPU's half dtypes with native matmul instructions (from its flags),
    # or None: not known (every dtype judged by its rate).
    native: object = None
    # What a step costs per launch (`step_time.launches`), by the dtype it
    # computes in ("float32": O0's; a half dtype: O2's): a dict or a
    # callable; None: `LAUNCH_SECONDS` on a GPU, not known on a CPU.
    launch: object = None
    # Values a second one elementwise op computes, by dtype: a dict or a
    # callable; None: the memory bandwidth's, each value read and written.
    elementwise: object = None

    def __post_init__(self):
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"`kind` must be 'gpu' or 'cpu'. Received: kind={self.kind!r}")
        if self.native is not None and (
            isinstance(self.native, str) or not set(self.native) <= {"float16", "bfloat16"}
        ):
            raise ValueError(
                "`native` must be None or a tuple of 'float16' and 'bfloat16'. "
                f"Received: native={self.native!r}"
            )

    def matmul_rate(self, dtype, tf32=False, aligned=True):
        """FLOP/s of a matmul computing in `dtype` (`tf32`: float32 matmuls
        on TF32 tensor cores, as TensorFlow does by default on Ampere and
        later; `aligned`: a 16-bit matmul's dimensions are multiples of 8;
        `"float8"`: an FP8 matmul, at the bfloat16 rate without FP8 cores)."""
        if dtype == "float8":
            if self.float8 is None:
                return self.matmul_rate("bfloat16", tf32, aligned)
            return self.float8 if aligned else self.matmul_rate("bfloat16", tf32, aligned)
        if dtype in ("float16", "bfloat16"):
            rate = getattr(self, dtype)
            if rate is None:
                return self.float32
            if self.kind == "cpu":
                return rate
            return rate if aligned else HALF_CUDA_CORE_FACTOR * self.float32
        if tf32 and self.tf32 is not None:
            return self.tf32
        return self.float32

    def native_half(self, dtype):
        """Whether the device multiplies `dtype` natively: a GPU's tensor
        cores; a CPU's flags (`native`; None: not known)."""
        return self.kind != "cpu" or self.native is None or dtype in self.native

    def launch_seconds(self, dtype):
        """Seconds a launch costs a step computing in `dtype` (None: not known)."""
        if self.launch is None:
            return LAUNCH_SECONDS if self.kind == "gpu" else None
        return self.launch(dtype) if callable(self.launch) else self.launch.get(dtype)

    def elementwise_rate(self, dtype):
        """Values a second an elementwise op computes in `dtype`."""
        if self.elementwise is None:
            return self.bandwidth / (2 * (4 if dtype == "float32" else 2))
        return self.elementwise(dtype) if callable(self.elementwise) else self.elementwise[dtype]

    def o0_rate(self, tf32):
        """FLOP/s the bound charges O0's float32 matmuls at (`O0_ATTAINED`)."""
        if self.kind == "cpu":
            return self.float32 * O0_ATTAINED["cpu"]
        if tf32 and self.tf32 is not None:
            return self.tf32 * O0_ATTAINED["tf32"]
        return self.float32 * O0_ATTAINED["float32"]

    def bound_rate(self, dtype, tf32=False, aligned=True):
        """FLOP/s the bound charges the level's matmuls in `dtype` at: their
        peak on a GPU; on a CPU no less than float32's measured rate."""
        rate = self.matmul_rate(dtype, tf32, aligned)
        return max(rate, self.float32) if self.kind == "cpu" else rate


HALF_CUDA_CORE_FACTOR = 2.0
LAUNCH_SECONDS = 5e-6
O0_ATTAINED = {"tf32": 0.2, "float32": 0.25, "cpu": 0.5}

GPUS = {
    "H100": Peaks("NVIDIA H100 SXM", 989e12, 989e12, 495e12, 67e12, 3.35e12, 1979e12),
    "H200": Peaks("NVIDIA H200 SXM", 989e12, 989e12, 495e12, 67e12, 4.8e12, 1979e12),
    "A100": Peaks("NVIDIA A100 SXM 80GB", 312e12, 312e12, 156e12, 19.5e12, 2.039e12),
    "L4": Peaks("NVIDIA L4", 121e12, 121e12, 60e12, 30.3e12, 0.3e12, 242e12),
    "T4": Peaks("NVIDIA T4", 65e12, None, None, 8.1e12, 0.32e12),
}


def peaks_of(device, argument="device"):
    """The `Peaks` of a device: a GPU named as in `GPUS` (any case), `"cpu"`
    (this machine's, measured), a `Peaks`, or None: this machine's first
    GPU (the H100's peaks under its own name where `GPUS` does not name it
    exactly), else its CPU."""
    if isinstance(device, Peaks):
        return device
    if device is None:
        return this_machine()
    if isinstance(device, str) and device.lower() == "cpu":
        return this_cpu()
    if isinstance(device, str) and device.upper() in GPUS:
        return GPUS[device.upper()]
    raise ValueError(
        f"`{argument}` must be 'cpu' (this machine's CPU, measured), one of "
        f"{', '.join(GPUS)}, None (this machine) or a `Peaks` of your own. "
        f"Received: {argument}={device!r}"
    )


def this_machine():
    """The `Peaks` of the GPU this backend sees (one `GPUS` names exactly:
    an H100 PCIe or an L40S is not in the table, and gets the H100's
    peaks under its own name), else of this machine's CPU."""
    from keras_mp._src import backends

    try:
        name = backends.current.gpu_name()
    except Exception:  # No usable GPU runtime.
        name = None
    return gpu_of_name(name) if name else this_cpu()


def gpu_of_name(name):
    """The `Peaks` of a GPU as its driver names it: `GPUS`' entry where the
    name is exactly one of them (an L40S is not an L4, an H100 PCIe not the
    SXM), else the H100's peaks under the GPU's own name."""
    board = re.search(r"PCIE|NVL", name, re.IGNORECASE)  # not the SXM of the table
    for known, peaks in GPUS.items():
        if not board and re.search(rf"\b{known}\b", name, re.IGNORECASE):
            return peaks
    return dataclasses.replace(
        GPUS["H100"], name=f"{name} (not in the table: an H100 SXM's peaks; pass device=)"
    )


def this_cpu(half=("float16", "bfloat16")):
    """This machine's CPU with this process's backend: matmul rates and
    memory bandwidth measured (`cpu_rates.py`, once per process); the half
    dtypes not in `half` at float32's rate, not timed. Launches and
    elementwise ops are timed when first asked for."""
    from keras_mp._src import backends
    from keras_mp._src.backends import cpu_rates

    flags = cpu_rates.cpu_flags()
    native = cpu_rates.native(flags, "bfloat16")
    float32 = cpu_rates.matmul_rate("float32")
    # Keras's PyTorch backend multiplies float16 in float32 on a CPU.
    computes_float16 = backends.current.computes_half_matmuls("float16")
    return Peaks(
        f"{cpu_rates.cpu_name()} ({', '.join(native) or 'no native bfloat16'}) "
        f"with {backends.current.NAME}",
        float16=cpu_rates.matmul_rate("float16")
        if computes_float16 and "float16" in half
        else float32,
        bfloat16=cpu_rates.matmul_rate("bfloat16") if "bfloat16" in half else float32,
        tf32=None,
        float32=float32,
        bandwidth=cpu_rates.memory_bandwidth(),
        kind="cpu",
        native=tuple(d for d in ("float16", "bfloat16") if cpu_rates.native(flags, d))
        if flags
        else None,
        launch=cpu_rates.launch_seconds,
        elementwise=cpu_rates.elementwise_rate,
    )
