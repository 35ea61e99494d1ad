"""Peak rates of the GPUs the speed report predicts for, as data.

Dense (not sparse) tensor-core rates from NVIDIA's data sheets, in FLOP/s,
and memory bandwidth in bytes/s. A rate of None means the GPU has no such
unit: T4 (Turing) has no bfloat16 and no TF32 tensor cores, so bfloat16
matmuls run at its float32 rate there and TF32 is float32.

`float8`: FP8 tensor cores (Hopper, Ada); None where there are none (A100,
T4): a layer that quantizes to FP8 and back computes its matmul in
bfloat16 there.

`HALF_CUDA_CORE_FACTOR`: a 16-bit matmul whose dimensions are not multiples
of 8 cannot use the tensor cores' fast path; the report counts it at twice
the float32 (CUDA-core) rate, what half arithmetic reaches without them.
`LAUNCH_SECONDS`: the host and launch cost of one kernel, hidden only when
a step's kernels run longer than it takes to launch them.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Peaks:
    name: str
    float16: float
    bfloat16: object  # None: no bfloat16 tensor cores
    tf32: object  # None: no TF32 tensor cores
    float32: float
    bandwidth: float  # bytes/s
    float8: object = None  # None: no FP8 tensor cores

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
            return rate if aligned else HALF_CUDA_CORE_FACTOR * self.float32
        if tf32 and self.tf32 is not None:
            return self.tf32
        return self.float32


HALF_CUDA_CORE_FACTOR = 2.0
LAUNCH_SECONDS = 5e-6

GPUS = {
    "H100": Peaks("NVIDIA H100 SXM", 989e12, 989e12, 495e12, 67e12, 3.35e12, 1979e12),
    "H200": Peaks("NVIDIA H200 SXM", 989e12, 989e12, 495e12, 67e12, 4.8e12, 1979e12),
    "A100": Peaks("NVIDIA A100 SXM 80GB", 312e12, 312e12, 156e12, 19.5e12, 2.039e12),
    "L4": Peaks("NVIDIA L4", 121e12, 121e12, 60e12, 30.3e12, 0.3e12, 242e12),
    "T4": Peaks("NVIDIA T4", 65e12, None, None, 8.1e12, 0.32e12),
}


def peaks_of(gpu):
    """The `Peaks` of a GPU named as in `GPUS` (any case), or given as one."""
    if isinstance(gpu, Peaks):
        return gpu
    if isinstance(gpu, str) and gpu.upper() in GPUS:
        return GPUS[gpu.upper()]
    raise ValueError(
        f"`gpu` must be one of {', '.join(GPUS)} (or a `Peaks` of your own). Received: gpu={gpu!r}"
    )
