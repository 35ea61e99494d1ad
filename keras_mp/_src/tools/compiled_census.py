"""The compiled program's census: how much of a train step's matmul and
convolution work runs in half, read from the program the backend builds
(JAX's lowered HLO, TensorFlow's traced graph, PyTorch's dispatched ops),
not from the policies that should make it so.

`census(model, x, y)` takes a compiled model (at a keras_mp level or under
a Keras dtype policy) and one batch; `speed_report`'s "Matmul work in half"
is its prediction, and the tests hold the two together
(`tests/tools/test_compiled_census.py`).
"""

import collections
import dataclasses

from keras_mp._src import backends
from keras_mp._src.precision.levels import FLOAT8
from keras_mp._src.precision.levels import HALF_DTYPES


@dataclasses.dataclass(frozen=True)
class Census:
    """FLOPs of one train step's matmuls and convolutions by the dtype they
    compute in (`"float16 x float32"` for mixed operands; `"float8"` for
    FP8 operands or values quantized to FP8 and back), the share in float16,
    bfloat16 or FP8, and the share in FP8."""

    flops: dict
    half_share: float
    float8_share: float = 0.0

    def __str__(self):
        by_dtype = ", ".join(f"{d} {n:,}" for d, n in sorted(self.flops.items()))
        fp8 = f", {100 * self.float8_share:.1f}% in FP8" if self.float8_share else ""
        return f"{100 * self.half_share:.1f}% of the matmul FLOPs in half{fp8} ({by_dtype})"


def census(model, x, y):
    """The `Census` of `model`'s train step on the batch `(x, y)`.

    JAX and TensorFlow trace the step without running it; PyTorch runs one
    `train_on_batch` and puts every variable back.
    """
    flops = collections.Counter()
    for _, dtype, n in backends.current.train_step_matmuls(model, (x, y)):
        flops[dtype] += n
    total = sum(flops.values()) or 1
    half = sum(n for dtype, n in flops.items() if dtype in HALF_DTYPES + (FLOAT8,))
    return Census(dict(flops), half / total, flops[FLOAT8] / total)
