"""The compiled program's census: how much of a train step's matmul and
convolution work runs in half, read from the program the backend builds
(JAX's lowered HLO, TensorFlow's traced graph, PyTorch's dispatched ops),
not from the policies that should make it so.

`census(model, x, y)` takes a compiled model (at a keras_mp level or under
a Keras dtype policy) and one batch; `speed_report`'s "Matmul work in half"
is its prediction, and the tests hold the two together
(`tests/tools/test_compiled_census.py`). `fp8_gemms(model, x, y)` counts
its matmuls whose operands are FP8 themselves. `memory(model, x, y)` is the
same step's memory, as far as the backend exposes it.
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


def fp8_gemms(model, x, y):
    """`{"float8_e4m3fn x float8_e5m2": count, ...}`: the matmuls of
    `model`'s train step on the batch `(x, y)` whose two operands are FP8
    themselves (the operands' dtypes, sorted), in the program the backend
    builds before any compiler pass: JAX's lowered StableHLO, TensorFlow's
    traced graph, PyTorch's dispatched `_scaled_mm` (one `train_on_batch`,
    every variable put back). An FP8 layer's step holds one E4M3 x E4M3
    (forward) and two with an E5M2 gradient (backward)."""
    from keras_mp._src.backends import fp8

    pairs = fp8.train_step_gemms(model, (x, y))
    return dict(collections.Counter(" x ".join(pair) for pair in pairs))


@dataclasses.dataclass(frozen=True)
class MemoryCensus:
    """Bytes one train step holds beyond its variables and its batch.

    `held`: its working memory at its peak: on JAX, XLA's temporaries of
    `fit`'s step as compiled for this machine (its buffer assignment, the
    state donated as `fit` donates it); on PyTorch, the most bytes of the
    tensors the step creates that are alive at once; None on TensorFlow (a
    traced graph allocates nothing). `saved`: `{dtype: bytes}` kept for the
    backward pass: the tensors autograd saves (PyTorch, each storage once),
    the forward values the gradient's ops read in the traced graph
    (TensorFlow); None on JAX (XLA's buffers hold no dtype of their own).
    """

    held: object
    saved: object

    @property
    def saved_bytes(self):
        return None if self.saved is None else sum(self.saved.values())

    def __str__(self):
        parts = []
        if self.held is not None:
            parts.append(f"{self.held / 2**20:.3g} MiB held")
        if self.saved is not None:
            by_dtype = ", ".join(f"{d} {n / 2**20:.3g}" for d, n in sorted(self.saved.items()))
            parts.append(f"{self.saved_bytes / 2**20:.3g} MiB saved for backward ({by_dtype})")
        return "; ".join(parts)


def memory(model, x, y):
    """The `MemoryCensus` of `model`'s train step on the batch `(x, y)`.

    JAX compiles the step and TensorFlow traces it, without running it;
    PyTorch runs one `train_on_batch` and puts every variable back.
    """
    held, saved = backends.current.train_step_memory(model, (x, y))
    return MemoryCensus(held, saved)


def largest_tensor(model, x, y):
    """The elements of the largest floating-point tensor in `model`'s train
    step on the batch `(x, y)`: JAX's lowered HLO and TensorFlow's traced
    graph (a loop's body included), PyTorch's tensors of one step (run, and
    every variable put back). A language model whose loss is chunked holds
    no tensor of its logits' size (`lm_loss.py`)."""
    return backends.current.train_step_largest(model, (x, y))
