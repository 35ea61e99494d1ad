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
from keras_mp._src.precision.levels import HALF_DTYPES


@dataclasses.dataclass(frozen=True)
class Census:
    """FLOPs of one train step's matmuls and convolutions by the dtype they
    compute in (`"float16 x float32"` for mixed operands), and the share in
    float16 or bfloat16."""

    flops: dict
    half_share: float

    def __str__(self):
        by_dtype = ", ".join(f"{d} {n:,}" for d, n in sorted(self.flops.items()))
        return f"{100 * self.half_share:.1f}% of the matmul FLOPs in half ({by_dtype})"


def census(model, x, y):
    """The `Census` of `model`'s train step on the batch `(x, y)`.

    JAX and TensorFlow trace the step without running it; PyTorch runs one
    `train_on_batch` and puts every variable back.
    """
    flops = collections.Counter()
    for _, dtype, n in backends.current.train_step_matmuls(model, (x, y)):
        flops[dtype] += n
    total = sum(flops.values())
    half = sum(n for dtype, n in flops.items() if dtype in HALF_DTYPES)
    return Census(dict(flops), half / total if total else 0.0)
