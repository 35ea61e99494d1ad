"""Adam's moments in low precision (MS-AMP's O2): 3 bytes a weight, not 8.

`LossScaleOptimizer(Adam(...), moment_dtypes="float8")` keeps Adam's (or
AdamW's) first moment in FP8 E4M3 with a per-tensor scale and its second
moment in float16 with a per-tensor scale (`("float8", "bfloat16")`: in
bfloat16, whose range needs no scale), as MS-AMP's O2 does: 62.5% less
optimizer state than float32 Adam. Each step reads the moments into
float32, updates them with the inner optimizer's settings, computes the
weight's update from the float32 values (Keras's Adam, line for line), and
writes them back rounded: the scale of each is its tensor's largest
magnitude over the format's largest value, so the whole tensor uses the
format's range.

The FP8 moment is kept as its 8-bit codes (`uint8`): what every backend
saves, loads and shards (a `float8_e4m3fn` variable does not round-trip a
`.keras` file on every backend). The codes are E4M3's bit patterns:
sign, 4 exponent bits (bias 7), 3 mantissa bits.

Each write rounds stochastically (`stochastic_round`): up or down to the
format's neighbours with the probabilities that make the expected stored
value the float32 one. Rounded to nearest, a moment whose step changes it
by less than half its format's spacing never moves: bfloat16's second
moment at beta_2 = 0.999 (0.1% a step against a half spacing of 0.39%) kept
its first value for thousands of steps, and an E4M3 first moment stayed put
while its gradient drifted slowly. The dither is a hash of the element's
index, the tensor and the step, not a random generator: no state, and a
resumed run repeats the same roundings bit for bit.

A float16 second moment flushes to zero the entries more than about 2**39
below its tensor's largest (a squared gradient 2**19.5 below the largest
gradient); the update of such an entry is computed from this step's
float32 value, as every entry's is.
"""

import contextlib
import math

import keras
import ml_dtypes
import numpy as np
from keras import ops

from keras_mp._src import backends

FIRST = ("float8", "float16", "bfloat16", "float32")
SECOND = ("float16", "bfloat16", "float32")
_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_FLOAT16_TOP = 2.0**15  # the largest second moment maps here (float16's max: 65504)
# Value of each E4M3 code (NaN codes read as 0: never written).
_E4M3_VALUES = np.nan_to_num(
    np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
)


def check_argument(moment_dtypes):
    """`moment_dtypes` as `(first, second)` dtype names, or None."""
    if moment_dtypes is None:
        return None
    if moment_dtypes == "float8":
        return ("float8", "float16")
    if (
        isinstance(moment_dtypes, (tuple, list))
        and len(moment_dtypes) == 2
        and moment_dtypes[0] in FIRST
        and moment_dtypes[1] in SECOND
    ):
        return tuple(moment_dtypes)
    raise ValueError(
        "`moment_dtypes` must be None (the inner optimizer's float32), "
        "'float8' (the first moment in FP8, the second in float16), or a "
        f"pair (first, second) with first one of {', '.join(FIRST)} and "
        f"second one of {', '.join(SECOND)}. Received: moment_dtypes={moment_dtypes!r}"
    )


def check(inner_optimizer, moment_dtypes, master_weights):
    """`moment_dtypes` checked (`check_argument`), for an inner Adam or
    AdamW (their update is computed here) without compensated updates."""
    moment_dtypes = check_argument(moment_dtypes)
    if moment_dtypes is None:
        return None
    if master_weights == "compensated":
        raise ValueError(
            "`moment_dtypes` and `master_weights='compensated'` both change "
            "how Adam's moments are stored: choose one. Received: "
            f"moment_dtypes={moment_dtypes!r}, master_weights='compensated'"
        )
    if getattr(type(inner_optimizer), "update_step", None) is not keras.optimizers.Adam.update_step:
        raise ValueError(
            "`moment_dtypes` keeps Adam's moments in low precision and computes "
            "its update in float32: the inner optimizer must be "
            "`keras.optimizers.Adam` or `AdamW`. Received: inner optimizer "
            f"{type(inner_optimizer).__name__}, moment_dtypes={moment_dtypes!r}"
        )
    return moment_dtypes


def bytes_per_weight(moment_dtypes, slots=2):
    """Bytes of optimizer state a weight (the per-tensor scales aside)."""
    if moment_dtypes is None:
        return 4 * slots
    size = {"float8": 1, "float16": 2, "bfloat16": 2, "float32": 4}
    return size[moment_dtypes[0]] + size[moment_dtypes[1]]


def _storage_dtype(dtype):
    return "uint8" if dtype == "float8" else dtype


class LowPrecisionMoments:
    """Adam's moments of `inner_optimizer` in `moment_dtypes`, each with its
    scale; installed on the inner optimizer before it is built."""

    def __init__(self, inner_optimizer, moment_dtypes):
        self.optimizer = inner_optimizer
        self.dtypes = {
            "momentum": moment_dtypes[0],
            "velocity": moment_dtypes[1],
            "velocity_hat": moment_dtypes[1],
        }
        self.scales = {}  # id of a moment variable -> its scale variable

    @contextlib.contextmanager
    def building(self, layout_of):
        """While the inner optimizer builds: its moments in their dtypes
        (and `layout_of(variable)`'s layout), each with a float32 scale."""
        optimizer = self.optimizer

        def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
            dtype = self.dtypes.get(name)
            if dtype is None or dtype == "float32":
                dtype = reference_variable.dtype
            prefix = f"{reference_variable.path.replace('/', '_')}_{name or 'var'}"
            layout = layout_of(reference_variable)
            moment = optimizer.add_variable(
                shape=reference_variable.shape,
                initializer=initializer,
                dtype=_storage_dtype(dtype),
                name=prefix,
                layout=layout,
            )
            if dtype in ("float8", "float16"):
                self.scales[id(moment)] = optimizer.add_variable(
                    shape=(), initializer="ones", dtype="float32", name=f"{prefix}_scale"
                )
            return moment

        object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)
        try:
            yield
        finally:
            del optimizer.__dict__["add_variable_from_reference"]
        self._install()

    def read(self, moment):
        """A moment's value in float32."""
        scale = self.scales.get(id(moment))
        if keras.backend.standardize_dtype(moment.dtype) == "uint8":
            table = ops.convert_to_tensor(_E4M3_VALUES)
            value = ops.take(table, ops.cast(moment, "int32"))
        else:
            value = ops.cast(moment, "float32")
        return value if scale is None else ops.multiply(value, scale)

    def write(self, moment, value, salt=0):
        """Writes a float32 value, rounded stochastically to the moment's
        format (`salt`: which of a variable's moments, for the dither)."""
        scale = self.scales.get(id(moment))
        dtype = keras.backend.standardize_dtype(moment.dtype)
        if scale is not None:
            top = _E4M3_MAX if dtype == "uint8" else _FLOAT16_TOP
            amax = ops.max(ops.abs(value))
            new_scale = ops.where(amax > 0, ops.divide(amax, top), ops.ones_like(amax))
            self.optimizer.assign(scale, new_scale)
            value = ops.divide(value, new_scale)
        if dtype == "float32":
            self.optimizer.assign(moment, value)
            return
        seed = ops.add(ops.multiply(ops.cast(self.optimizer.iterations, "int32"), 4), salt)
        rounded = stochastic_round(value, dtype, seed)
        if dtype == "uint8":
            self.optimizer.assign(moment, _e4m3_codes(rounded))
        else:
            self.optimizer.assign(moment, ops.cast(rounded, dtype))

    def _install(self):
        optimizer = self.optimizer

        def update_step(gradient, variable, learning_rate):
            """Keras's Adam step, its moments read and written here."""
            index = optimizer._get_variable_index(variable)
            m, v = optimizer._momentums[index], optimizer._velocities[index]
            gradient = ops.cast(gradient, "float32")
            learning_rate = ops.cast(learning_rate, "float32")
            step = ops.cast(optimizer.iterations + 1, "float32")
            beta_1, beta_2 = (ops.cast(b, "float32") for b in (optimizer.beta_1, optimizer.beta_2))
            alpha = ops.divide(
                ops.multiply(learning_rate, ops.sqrt(1.0 - ops.power(beta_2, step))),
                1.0 - ops.power(beta_1, step),
            )
            m_old, v_old = self.read(m), self.read(v)
            # `1 - beta` as Keras's Adam has it: a Python float.
            m_new = ops.add(
                m_old, ops.multiply(ops.subtract(gradient, m_old), 1 - optimizer.beta_1)
            )
            v_new = ops.add(
                v_old, ops.multiply(ops.subtract(ops.square(gradient), v_old), 1 - optimizer.beta_2)
            )
            salt = ops.multiply(index, 65537)  # each variable's moments dithered apart
            self.write(m, m_new, salt)
            self.write(v, v_new, ops.add(salt, 1))
            if optimizer.amsgrad:
                v_hat = optimizer._velocity_hats[index]
                v_new = ops.maximum(self.read(v_hat), v_new)
                self.write(v_hat, v_new, ops.add(salt, 2))
            update = ops.divide(
                ops.multiply(m_new, alpha), ops.add(ops.sqrt(v_new), optimizer.epsilon)
            )
            optimizer.assign_sub(variable, ops.cast(update, variable.dtype))

        optimizer.update_step = update_step
        backends.current.step_each_variable(optimizer)


def _e4m3_codes(x):
    """The E4M3 codes (uint8) of float32 `x`, rounded to E4M3 (clipped to
    +-448): sign, exponent (bias 7), mantissa; subnormals below 2**-6."""
    x = ops.cast(ops.cast(ops.clip(x, -_E4M3_MAX, _E4M3_MAX), "float8_e4m3fn"), "float32")
    magnitude = ops.abs(x)
    bits = ops.view(magnitude, "int32")
    exponent = ops.subtract(ops.right_shift(bits, 23), 120)  # float32's bias 127, E4M3's 7
    mantissa = ops.bitwise_and(ops.right_shift(bits, 20), 7)
    normal = ops.bitwise_or(ops.left_shift(exponent, 3), mantissa)
    subnormal = ops.cast(ops.round(ops.multiply(magnitude, 512.0)), "int32")  # m x 2**-9
    code = ops.where(magnitude >= 2.0**-6, normal, subnormal)
    code = ops.where(x < 0, ops.add(code, 128), code)
    return ops.cast(code, "uint8")


# Mantissa bits each format keeps (float32 keeps 23), and the exponent of
# its smallest normal number (below it, fixed spacing: subnormals; None for
# bfloat16, whose exponents are float32's: XLA flushes float32's subnormals).
_FORMATS = {"bfloat16": (7, None), "float16": (10, -14), "uint8": (3, -6)}


def stochastic_round(x, dtype, seed):
    """float32 `x` rounded to `dtype`'s values (`"uint8"`: E4M3's), up or down
    with the probabilities that make the expected result `x`; still float32.

    The float32 bits below the format's mantissa are dropped after adding a
    dither (an integer below their weight), so the carry rounds up with the
    probability of the dropped fraction; below the smallest normal number the
    same is done on the subnormal grid. The dither hashes each element's
    index with `seed` (an int32 tensor: the step and which moment).
    """
    kept, min_exponent = _FORMATS[dtype]
    dropped = 23 - kept
    if dtype == "uint8":
        x = ops.clip(x, -_E4M3_MAX, _E4M3_MAX)
    dither = _hash(ops.reshape(ops.arange(math.prod(x.shape) or 1, dtype="int32"), (-1,)), seed)
    dither = ops.reshape(dither[: math.prod(x.shape)], x.shape)
    negative = ops.view(x, "int32") < 0  # the sign bit (XLA flushes subnormals in `x < 0`)
    magnitude = ops.abs(x)
    bits = ops.minimum(ops.view(magnitude, "int32"), 0x7F800000)  # NaN's payloads: no carry
    low = ops.bitwise_and(dither, (1 << dropped) - 1)
    truncated = ops.bitwise_and(ops.add(bits, low), ~((1 << dropped) - 1))
    rounded = ops.view(truncated, "float32")
    if min_exponent is not None:
        # Subnormals: multiples of 2**(min_exponent - kept).
        spacing = 2.0 ** (min_exponent - kept)
        fraction = ops.divide(ops.cast(ops.bitwise_and(dither, (1 << 23) - 1), "float32"), 2.0**23)
        steps = ops.floor(ops.add(ops.divide(magnitude, spacing), fraction))
        rounded = ops.where(magnitude < 2.0**min_exponent, ops.multiply(steps, spacing), rounded)
    if dtype == "uint8":  # a carry past E4M3's largest value would be NaN's code
        rounded = ops.minimum(rounded, _E4M3_MAX)
    rounded = ops.where(negative, ops.negative(rounded), rounded)
    return ops.where(ops.isnan(x), x, rounded)  # a NaN moment stays NaN


def _shift_right(h, bits):
    """Logical right shift of int32 `h` (arithmetic shift, sign bits masked)."""
    return ops.bitwise_and(ops.right_shift(h, bits), (1 << (32 - bits)) - 1)


def _hash(index, seed):
    """A well-mixed int32 per element of `index` (int32) and `seed` (lowbias32)."""
    h = ops.bitwise_xor(ops.multiply(index, 0x27D4EB2D), ops.multiply(seed, 0x165667B1))
    h = ops.bitwise_xor(h, _shift_right(h, 16))
    h = ops.multiply(h, 0x21F0AAAD)
    h = ops.bitwise_xor(h, _shift_right(h, 15))
    h = ops.multiply(h, 0x735A2D97)
    return ops.bitwise_xor(h, _shift_right(h, 15))
