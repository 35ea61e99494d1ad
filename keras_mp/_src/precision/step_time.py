"""A train step's time at O0 and at a level, predicted from the layers'
accounts (`step_cost.py`) and a device's rates (`backends/gpu_peaks.py`):
what `amp_level="auto"` decides from, and what the speed report predicts.

On a CPU a step runs its ops one after another, so its time is the sum of

- its matmuls, at the rate measured for their dtype (an emulated half
  dtype's is slow, and counts so);
- its other work: three passes over each layer's outputs (the forward op
  and the gradient's two), at the rate one elementwise op measured in the
  layer's dtype (a CPU converts most half elementwise ops to float32: its
  gain there is the bytes, if any);
- its casts, each value at the half dtype's elementwise rate;
- the optimizer's update: `3 + 2 x slots` passes over each trainable
  weight in float32, the same at O0 and at O2;
- its launches (`launches`), at what one costs with this backend at that
  precision (`cpu_rates.launch_seconds`: a tiny proxy's whole step per
  launch, its fixed costs and all that the level adds to a small step).

On a GPU the host launches kernels while earlier ones run: its time is the
larger of its launches (`LAUNCH_SECONDS` each) and its work (the layers'
rooflines, the casts and the update as bytes).

The batch: `synthetic_batch` gives the model's inputs at `fit`'s default
batch of 32, each other open dimension (a sequence's length) at 128.
"""

import dataclasses

import keras

from keras_mp._src import keras_internals
from keras_mp._src.backends import cpu_rates
from keras_mp._src.precision import boundaries
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import step_cost

BATCH = 32
OPEN_DIMENSION = 128


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds at one precision, by what they go to."""

    matmuls: float
    other: float  # elementwise work
    casts: float
    update: float
    launches: int
    per_launch: float  # seconds a launch; 0.0: not known
    kind: str = "cpu"

    @property
    def work(self):
        return self.matmuls + self.other + self.casts + self.update

    @property
    def launch_seconds(self):
        return self.launches * self.per_launch

    @property
    def seconds(self):
        if self.kind == "gpu":
            return max(self.work, self.launch_seconds)
        return self.work + self.launch_seconds

    @property
    def launch_bound(self):
        """Its launches take longer than its work."""
        return self.launch_seconds > self.work


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A step at O0 and at `level` in `dtype`, on `device` (a name)."""

    level: str
    dtype: str
    o0: StepTime
    at_level: StepTime
    device: str = ""
    batch: str = ""  # the batch it was predicted for, in words

    @property
    def speedup(self):
        """O0's seconds over the level's: below 1, the level is slower."""
        return self.o0.seconds / self.at_level.seconds

    def explain(self):
        """One clause: the prediction and what it comes from."""
        a, b = self.o0, self.at_level
        each = ""
        if a.per_launch and b.per_launch:
            each = f" at {_us(a.per_launch)} -> {_us(b.per_launch)} each"
        text = (
            f"its step{self.batch} is predicted at {self.speedup:.2f}x O0's speed "
            f"({_ms(a.seconds)} -> {_ms(b.seconds)}): {a.launches} -> {b.launches} "
            f"launches{each} ({_ms(a.launch_seconds)} -> {_ms(b.launch_seconds)}), "
            f"matmuls {_ms(a.matmuls)} -> {_ms(b.matmuls)}, other work, casts and "
            f"the update {_ms(a.work - a.matmuls)} -> {_ms(b.work - b.matmuls)}"
        )
        if b.launch_bound:
            text += "; its launches take longer than its work"
        return text


def _ms(seconds):
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms"


def _us(seconds):
    return f"{seconds * 1e6:.3g} us"


def launches(model, accounts):
    """Kernels (on a CPU, op groups) a step launches: three a layer with
    work or bytes (its forward and two backward), one a cast, one an
    update a trainable variable."""
    n = sum(3 + a.casts for a in accounts.values() if a.flops or a.moved)
    return n + len(model.trainable_variables)


def step_time(model, accounts, peaks, dtype, slots=2):
    """The `StepTime` of a step whose layers are `accounts`, computing in
    `dtype` (`"float32"` at O0, else the level's half dtype), on `peaks`."""
    weights = sum(step_cost.numel(v.shape) for v in model.trainable_variables)
    count = launches(model, accounts)
    per_launch = peaks.launch_seconds(dtype) or 0.0
    if peaks.kind == "gpu":
        return StepTime(
            matmuls=sum(step_cost.layer_seconds(a, peaks, True) for a in accounts.values()),
            other=0.0,
            casts=sum(a.cast_bytes for a in accounts.values()) / peaks.bandwidth,
            update=weights * 4 * (3 + 2 * slots) / peaks.bandwidth,
            launches=count,
            per_launch=per_launch,
            kind="gpu",
        )
    return StepTime(
        matmuls=sum(
            a.step_flops / peaks.matmul_rate(_cpu_matmul_dtype(a, peaks))
            for a in accounts.values()
            if a.flops
        ),
        other=sum(3 * a.output_values / peaks.elementwise_rate(a.dtype) for a in accounts.values()),
        casts=sum(a.cast_values for a in accounts.values()) / peaks.elementwise_rate(dtype),
        update=weights * (3 + 2 * slots) / peaks.elementwise_rate("float32"),
        launches=count,
        per_launch=per_launch,
    )


def _cpu_matmul_dtype(account, peaks):
    """The dtype a CPU multiplies a layer's matmul in: a tied head's float32
    table is read in float32 where that CPU has no native instructions for
    the half dtype (`cpu_rates.tables_in_half`, `boundaries.py`), or where
    `KERAS_MP_TIED_HEAD` says so."""
    if account.matmul:
        return account.matmul
    half = account.dtype
    if boundaries.reads_a_float32_table(account.layer, half, account.variables):
        if not cpu_rates.tables_in_half(half, native=peaks.native_half(half)):
            return "float32"
    return half


def predict(model, calls, reference, amp, peaks, slots=2, batch=""):
    """The `Prediction` of `model`'s step traced as `calls`
    (`speed_trace.trace`) at `reference` (O0's settings) and at `amp`."""
    half = "bfloat16" if amp.float8 is not None else amp.half
    at_level = step_cost.accounts_at(model, calls, amp)
    at_o0 = step_cost.accounts_at(model, calls, reference)
    return Prediction(
        amp.name,
        amp.dtype_name,
        step_time(model, at_o0, peaks, "float32", slots),
        step_time(model, at_level, peaks, half if amp.level.computes_in_half else "float32", slots),
        peaks.name,
        batch,
    )


def synthetic_batch(model):
    """`(batch, words)`: the model's inputs as `KerasTensor`s at `BATCH`,
    other open dimensions at `OPEN_DIMENSION`, and the batch described;
    `(None, why)` where its inputs are not known (a subclassed model not
    built yet, or built on several inputs)."""
    if isinstance(model, keras.Sequential):
        inputs = model.inputs if model.built else None
        inputs = inputs[0] if inputs and len(inputs) == 1 else None
    elif layer_tree.is_graph(model):
        inputs = model.input
    else:
        # Built by a call: its first dimension is that batch's.
        shape = keras_internals.built_input_shape(model) if model.built else None
        inputs = keras.KerasTensor((None,) + tuple(shape[1:])) if _one_shape(shape) else None
    if inputs is None:
        return None, "its inputs are not known at compile (build it on a batch first)"
    opened = []

    def at_size(tensor):
        shape = tuple(tensor.shape)
        if any(d is None for d in shape[1:]):
            opened.append(tensor)
        sizes = (BATCH if shape[0] is None else shape[0],) + tuple(
            OPEN_DIMENSION if d is None else d for d in shape[1:]
        )
        return keras.KerasTensor(sizes, tensor.dtype)

    batch = keras.tree.map_structure(at_size, inputs)
    words = f" (at batch {BATCH}, `fit`'s default"
    words += f"; {OPEN_DIMENSION} for the lengths it leaves open)" if opened else ")"
    return batch, words


def _one_shape(shape):
    return (
        isinstance(shape, (tuple, list))
        and len(shape) > 0
        and all(d is None or isinstance(d, int) for d in shape)
    )
