"""FP8 as a level's dtype: which matmuls compute in 8 bits, and the recipe.

`amp_dtype="float8"` (O2, O3) computes in bfloat16 everywhere the level
computes in half, and the matmuls the rules choose (`rules.py`) in FP8: a
Dense or EinsumDense whose dtype policy is Keras's
`float8_from_mixed_bfloat16` (O2) or `float8_from_bfloat16` (O3), its
inputs and kernel quantized to E4M3 and its output gradient to E5M2, each
with a per-tensor scale from a history of amax values (delayed scaling, as
Transformer Engine's `DelayedScaling` and Accelerate's `FP8RecipeKwargs`).
Its matmul multiplies the FP8 operands themselves where the backend can
(`set_call`, `backends.fp8`: JAX and PyTorch), the same program on a CPU
and on a GPU with FP8 units; on TensorFlow, Keras's own quantize-dequantize
around a bfloat16 matmul.

The scales and histories are variables of the layer (`overwrite_with_gradient`:
the optimizer writes their new values); a skipped step leaves them as they
were, as it leaves the weights.
"""

import dataclasses
import math
import warnings

import keras
import numpy as np

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import ALLOW_LIST

# Keras's float8 layers, by exact class: a subclass's own `call` would be
# bypassed by Keras's `quantized_call` (and `quantize` refuses subclasses).
FLOAT8_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)
# FP8 GEMMs (cuBLASLt) need the contracted and output dimensions to be
# multiples of 16.
FLOAT8_MULTIPLE = 16
FORMATS = ("hybrid",)
# torchao's auto filter for tensorwise scaling: a GEMM with K <= 4096 and
# N <= 1024 ran slower in FP8 than in bfloat16 on an H100.
SMALL_GEMM = (4096, 1024)
AMAX_ALGORITHMS = ("max",)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How FP8 matmuls are scaled (delayed per-tensor scaling).

    The names follow Keras's `QuantizedFloat8DTypePolicy` and Transformer
    Engine's `DelayedScaling`; the defaults are theirs (and Accelerate's).

    Args:
        amax_history_length: how many steps of amax values a scale is
            computed from (the maximum over the window). Default 1024.
        fp8_format: `"hybrid"`: E4M3 forward (inputs, kernel), E5M2 for the
            output gradient. Keras's float8 layers compute this format only.
        amax_compute_algo: `"max"`: the maximum of the history. Keras's
            float8 layers compute this one only.
        margin: the scale leaves `2**margin` of headroom below the format's
            maximum. Keras's float8 layers compute with 0 only.
        small_gemm: `(input_dim, units)`: a matmul whose contracted
            dimension is at most the first and whose output dimension at
            most the second stays in bfloat16, too small for FP8 to pay
            (its quantizing costs more than its faster GEMM saves). Default
            `(4096, 1024)`, torchao's threshold for tensorwise scaling,
            measured on an H100 (a 1024 x 2048 x 1024 GEMM in FP8 at 0.80x
            bfloat16's speed, 4096 x 8192 x 16384 at 1.39x). None: every
            matmul the other rules choose, whatever its size (`allow=` puts
            one layer in FP8 whatever its size).
    """

    amax_history_length: int = 1024
    fp8_format: str = "hybrid"
    amax_compute_algo: str = "max"
    margin: int = 0
    small_gemm: tuple = SMALL_GEMM

    def __post_init__(self):
        n = self.amax_history_length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                "`amax_history_length` must be an integer of at least 1. "
                f"Received: amax_history_length={n!r}"
            )
        small = self.small_gemm
        if small is not None:
            if (
                not isinstance(small, (tuple, list))
                or len(small) != 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in small)
            ):
                raise ValueError(
                    "`small_gemm` must be None or a pair of non-negative integers "
                    f"(input_dim, units). Received: small_gemm={small!r}"
                )
            object.__setattr__(self, "small_gemm", tuple(small))
        _check_fixed("fp8_format", self.fp8_format, FORMATS)
        _check_fixed("amax_compute_algo", self.amax_compute_algo, AMAX_ALGORITHMS)
        _check_fixed("margin", self.margin, (0,))

    def get_config(self):
        return dataclasses.asdict(self)


def _check_fixed(argument, value, allowed):
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(
            f"`{argument}` must be one of {', '.join(repr(a) for a in allowed)}: "
            f"Keras's float8 layers compute with these only. "
            f"Received: {argument}={value!r}"
        )


def check_recipe(recipe, argument="float8_recipe"):
    """`recipe` as a `Float8Recipe` (None: the defaults; a dict: its keys)."""
    if recipe is None:
        return Float8Recipe()
    if isinstance(recipe, Float8Recipe):
        return recipe
    if isinstance(recipe, dict):
        unknown = sorted(set(recipe) - {f.name for f in dataclasses.fields(Float8Recipe)})
        if unknown:
            raise ValueError(
                f"`{argument}` has unknown keys {unknown}; allowed: "
                f"{', '.join(f.name for f in dataclasses.fields(Float8Recipe))}. "
                f"Received: {argument}={recipe!r}"
            )
        return Float8Recipe(**recipe)
    raise TypeError(
        f"`{argument}` must be a `keras_mp.Float8Recipe`, a dict of its "
        f"arguments, or None. Received: {argument}={recipe!r}"
    )


def policy(source, recipe):
    """The Keras float8 policy computing like `source` around its FP8 matmul."""
    return keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", source, amax_history_length=recipe.amax_history_length
    )


def source_of(policy):
    """The policy a float8 policy computes like around its FP8 matmul."""
    return keras.dtype_policies.get(policy.name.split("_from_", 1)[1])


def is_float8(layer):
    return layer.dtype_policy.quantization_mode == "float8"


def has_float8_path(layer):
    """A Dense or EinsumDense of Keras's own (not a subclass), without LoRA
    (Keras's float8 call has none)."""
    return type(layer) in FLOAT8_CLASSES and not getattr(layer, "lora_enabled", False)


def refuse_lora(layers):
    """Refuses a layer in FP8 with LoRA enabled (`enable_lora` after FP8
    training): Keras's float8 call has no LoRA path, and Keras cannot undo
    the layer's quantization, so its `fit` would fail at the first step."""
    for layer in layers:
        if getattr(layer, "lora_enabled", False) and is_float8(layer):
            raise ValueError(
                f"Layer {layer.name!r} computes in FP8 (policy "
                f"{layer.dtype_policy.name!r}) and has LoRA enabled: Keras's "
                "float8 layers have no LoRA path, and a layer's quantization "
                "cannot be undone. Build the model again and call "
                "`enable_lora` before `compile(..., amp_dtype='float8')` (a "
                "LoRA layer computes in bfloat16 there), or train this one "
                f"without LoRA. Received: layer {layer.name!r} with "
                f"lora_rank={layer.lora_rank}"
            )


def gemm_dims(layer):
    """The dimensions of the layer's GEMM that FP8 needs aligned, as
    `{name: size}`: the contracted one (`input_dim`) and the output one
    (`units`); EinsumDense's flattened. Only those known before the layer
    is built are given for an unbuilt one."""
    kernel = getattr(layer, "_kernel", None) if layer.built else None
    if isinstance(layer, keras.layers.EinsumDense):
        if kernel is None:
            return {}
        inputs, rest = layer.equation.split(",")
        weights = rest.split("->")[0]
        shape = dict(zip(weights, kernel.shape))
        contracted = math.prod(size for axis, size in shape.items() if axis in inputs)
        return {"input_dim": contracted, "units": math.prod(kernel.shape) // contracted}
    dims = {"units": layer.units}
    if kernel is not None:
        dims["input_dim"] = kernel.shape[0]
    return dims


def misaligned(layer):
    """`"units=250"`-style text of the GEMM dimensions that are not multiples
    of 16, or None."""
    bad = [f"{k}={v}" for k, v in gemm_dims(layer).items() if v % FLOAT8_MULTIPLE]
    return ", ".join(bad) or None


def too_small(layer, recipe):
    """`"input_dim=64, units=64"`-style text of a layer's GEMM too small for
    FP8 to pay under `recipe` (`Float8Recipe.small_gemm`), or None (it pays,
    or its size is not known yet: `size_unknown`)."""
    dims = _within_small_gemm(layer, recipe)
    if dims is None or len(dims) < 2:
        return None
    return ", ".join(f"{k}={v}" for k, v in sorted(dims.items()))


def size_unknown(layer, recipe):
    """Whether the size rule cannot decide yet: an unbuilt layer whose GEMM
    dimensions known so far are all within `small_gemm`. It stays in
    bfloat16 until built, and is decided then (`policies.apply`): FP8 is
    never chosen on a guess that it pays, nor refused on one that it does
    not."""
    dims = _within_small_gemm(layer, recipe)
    return dims is not None and len(dims) < 2


def _within_small_gemm(layer, recipe):
    """The layer's known GEMM dimensions, `{name: size}`, where none is over
    `recipe.small_gemm`; None where one is, or where there is no size rule."""
    if recipe is None or recipe.small_gemm is None:
        return None
    dims = gemm_dims(layer)
    limits = dict(zip(("input_dim", "units"), recipe.small_gemm))
    if any(size > limits[name] for name, size in dims.items()):
        return None
    return dims


def start_scales_from_weights(layer):
    """A built layer just quantized to FP8: its kernel's scale from the
    kernel's own amax (Keras starts every scale at 1, which rounds a
    pretrained kernel of std 3e-3 mostly to 0 in E4M3 until a step has
    trained it), as its first training step would have set it. A kernel
    not readable yet (a model built by `fit`, `keras_internals.readable_now`)
    was just initialized, not loaded: its first step sets its scale, as
    Keras's."""
    kernel = getattr(layer, "_kernel", None)
    if kernel is None or not hasattr(layer, "kernel_amax_history"):
        return
    if not keras_internals.readable_now(kernel):
        return
    values = keras.ops.cast(kernel, "float32")
    amax = float(keras.ops.convert_to_numpy(keras.ops.max(keras.ops.abs(values))))
    if not math.isfinite(amax) or amax <= 0.0:
        return
    history = np.zeros(layer.kernel_amax_history.shape, "float32")
    history[0] = amax
    layer.kernel_amax_history.assign(history)
    layer.kernel_scale.assign(amax / E4M3_MAX)


E4M3_MAX = 448.0


def set_call(layer, frozen):
    """Sets an FP8 layer's call, at each compile (`frozen`: whether the
    layer trains now).

    Its matmul is an FP8 GEMM where the backend has one (`backends.fp8`):
    FP8 operands into the dot, forward and both gradients, with Keras's
    scales and their update rule; Keras's own call (quantize-dequantize
    around a bfloat16 matmul) elsewhere.

    A layer that does not train (frozen after FP8 training): Keras moves its
    scales only through the optimizer, so its input scale would stay where
    training left it, and inputs that grow saturate E4M3. As Transformer
    Engine does in each forward pass, its input scale follows the amax
    history of what it takes in, at each training step (as BatchNorm's
    statistics are updated: assigned in `call`); its kernel does not
    change, nor its scale."""
    from keras_mp._src.backends import fp8

    gemm = fp8.current.gemm if fp8.current is not None else None
    follows = frozen and hasattr(layer, "inputs_amax_history")
    keras_internals.set_float8_call(
        layer,
        gemm,
        _follow_input_amax(layer) if follows else None,
        follows_input_amax=follows,
        fp8_gemm=gemm is not None,
    )


def _follow_input_amax(layer):
    def follow(inputs, training):
        if not training:
            return
        history = keras.quantizers.compute_float8_amax_history(
            inputs, keras.ops.convert_to_tensor(layer.inputs_amax_history)
        )
        layer.inputs_amax_history.assign(history)
        layer.inputs_scale.assign(
            keras.quantizers.compute_float8_scale(
                keras.ops.max(history, axis=0),
                keras.ops.convert_to_tensor(layer.inputs_scale),
                keras.ops.cast(E4M3_MAX, "float32"),
            )
        )

    return follow


def quantize_dequantize_note():
    """What FP8 computes on a backend without FP8 GEMMs (TensorFlow: its
    CPU has no FP8 matmul, and Keras's step compiles no XLA there), or
    None where FP8 operands go into the dot."""
    from keras_mp._src.backends import fp8

    if fp8.current is not None:
        return None
    return (
        f"on {backends.current.NAME}, FP8 is quantize-dequantize: Keras's float8 "
        "layers round their inputs, kernel and output gradient through FP8 and "
        "multiply in bfloat16 (no FP8 x FP8 matmul in the graph)"
    )


_WARNED = []


def warn_once_where_nothing_computes_fp8():
    """`amp_dtype="float8"` where no FP8 matmul runs: said once a process."""
    from keras_mp._src.precision.auto_level import float8_gemms_absent

    reason = float8_gemms_absent()
    if reason is not None and not _WARNED:
        _WARNED.append(reason)
        warnings.warn(f"keras_mp: amp_dtype='float8': {reason}.", stacklevel=4)
    return reason


def weighs_inputs(layer):
    """A layer that turns what it takes in into features with weights of
    its own (a matmul, a convolution, an embedding lookup): what comes after
    it is no longer the model's raw input."""
    return isinstance(layer, ALLOW_LIST + (keras.layers.Embedding,))


def first_layers(model):
    """Ids of the layers that take the model's raw inputs: the first layer
    with weights on each path from an input (looking inside nested models).
    Transformer Engine's recipes keep them, as the output layer, out of FP8.
    In a subclassed model, the first such layer its `call` runs
    (`weighted_in_call_order`)."""
    first = set()
    if layer_tree.is_subclassed(model):
        return {id(layer) for layer in weighted_in_call_order(model)[:1]}
    if isinstance(model, keras.Sequential):
        operations = [(layer, []) for layer in model.layers]
        for i in range(1, len(operations)):
            operations[i] = (operations[i][0], [operations[i - 1][0]])
    else:
        operations = keras_internals.operations_from_inputs(model)
    raw = set()  # ids of operations whose outputs are still the raw inputs
    for operation, parents in operations:
        if not all(id(p) in raw for p in parents):
            continue
        if layer_tree.is_container(operation):
            inner = first_layers(operation)
            first |= inner
            if not inner:
                raw.add(id(operation))
        elif weighs_inputs(operation):
            first.add(id(operation))
        else:
            raw.add(id(operation))
    return first


def weighted_in_call_order(model):
    """A subclassed model's layers with weights of their own, in the order
    its `call` first runs them: traced symbolically on the shape it was
    built on; in the order it holds them where that cannot be told (an
    unbuilt model, several inputs)."""
    held = [
        layer
        for layer in layer_tree.layers_in_order(model)[1:]
        if not layer_tree.is_container(layer) and weighs_inputs(layer)
    ]
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    shape = next(iter(shapes.values()), None) if len(shapes) == 1 else None
    if not model.built or not isinstance(shape, (tuple, list)):
        return held
    order = layer_tree.call_order(model, tuple(1 if d is None else d for d in shape))
    if order is None:
        return held
    ids = {id(layer) for layer in held}
    ran = [layer for layer in order if id(layer) in ids]
    return ran + [layer for layer in held if not any(layer is r for r in ran)]
