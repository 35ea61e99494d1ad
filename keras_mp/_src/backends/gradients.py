"""What every backend shares about gradients: the finiteness check, exact
on every dtype, and unscaling in float32 (the portable forms; `common.py`
re-exports them, and a backend module replaces what it does differently).
None brings a value to the host.
"""

import keras
from keras import ops

# Gradients of these dtypes are checked by their sum, which overflows only for
# values near float32's maximum (where the exact check takes over); narrower
# ones elementwise, since a float32 sum of them needs a float32 copy first.
WIDE_FLOATS = ("float32", "float64")


def is_indexed_slices(grad):
    return type(grad).__name__ == "IndexedSlices"


def dense_values(grad):
    """The values of a gradient (a `tf.IndexedSlices` contributes its values)."""
    return grad.values if is_indexed_slices(grad) else grad


def add_all(tensors):
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def exact_all_finite(grads):
    """`all(isfinite(g))` over every gradient, elementwise."""
    flags = [ops.all(ops.isfinite(g)) for g in grads]
    return flags[0] if len(flags) == 1 else ops.all(ops.stack(flags))


def all_finite(grads, exact=None, add=None):
    """Whether every value of every gradient is finite (no inf, no nan).

    The check reads each float32 gradient once with a plain sum: a sum is
    finite exactly when no value is inf or nan, except when finite values add
    up past float32's maximum. Only then does the exact elementwise check
    run, inside a `cond`, so the answer is always exact and the common case
    costs one read of each gradient. float16 and bfloat16 gradients get the
    elementwise check: a float32 sum of them needs a float32 copy first.

    Args:
        grads: list of gradient tensors; `None` entries are ignored.
        exact, add: a backend's own `exact_all_finite` and `add_all`.

    Returns:
        A boolean scalar tensor.
    """
    exact = exact or exact_all_finite
    grads = [dense_values(g) for g in grads if g is not None]
    if not grads:
        return ops.convert_to_tensor(True)
    wide = [g for g in grads if keras.backend.standardize_dtype(g.dtype) in WIDE_FLOATS]
    narrow = [g for g in grads if keras.backend.standardize_dtype(g.dtype) not in WIDE_FLOATS]
    flags = []
    if narrow:
        flags.append(exact(narrow))
    if wide:
        total = (add or add_all)([ops.cast(ops.sum(g), "float32") for g in wide])
        flags.append(
            ops.cond(
                ops.isfinite(total),
                lambda: ops.convert_to_tensor(True),
                lambda: exact(wide),
            )
        )
    return flags[0] if len(flags) == 1 else ops.logical_and(flags[0], flags[1])


def unscale(grads, scale, skip=(), keep_dtype=False, with_values=None):
    """Multiplies each gradient by `1 / scale`, in float32.

    A multiplication by the reciprocal, as `torch.amp.GradScaler` does: XLA
    fuses a multiply into each of the optimizer's update kernels that reads
    the gradient, where a division would be one more pass over every
    gradient. For a power-of-two scale (the dynamic scale with the default
    factors) the result is the same as dividing, bit for bit; otherwise it
    is within one float32 rounding of it.

    Args:
        grads: list of gradients (`None` entries pass through).
        scale: float32 scalar tensor, or None for 1: the gradients are only
            cast to float32 (no multiply per gradient).
        skip: indices of gradients to pass through untouched (variables with
            `overwrite_with_gradient`, whose "gradient" is a value).
        keep_dtype: whether to cast the results back to each gradient's dtype.
        with_values: `(indexed_slices, values) -> IndexedSlices` (TensorFlow).

    Returns:
        The list of unscaled gradients. Gradients of a narrower dtype come
        back as float32 (unless `keep_dtype`), so that a small gradient is not
        flushed to zero by the unscaling; the inner optimizer casts them to
        its variables' dtype.
    """
    inverse = None if scale is None else ops.divide(ops.convert_to_tensor(1.0, "float32"), scale)
    out = []
    for i, g in enumerate(grads):
        if g is None or i in skip:
            out.append(g)
        elif is_indexed_slices(g):
            out.append(
                (with_values or _no_indexed_slices)(
                    g, _multiply_float32(g.values, inverse, keep_dtype)
                )
            )
        else:
            out.append(_multiply_float32(g, inverse, keep_dtype))
    return out


def scale_of_grads(step, scale):
    """What the step's gradients were multiplied by: the loss scale, or None
    (1, nothing to unscale) where the loss never reached `scale_loss`
    (`Step.loss_unscaled`) or the scale is a fixed 1 (`Step.unit_scale`)."""
    return None if step.loss_unscaled or step.unit_scale else scale


def _no_indexed_slices(indexed_slices, values):
    raise TypeError(f"{type(indexed_slices).__name__} gradients exist on TensorFlow only.")


def _multiply_float32(g, inverse, keep_dtype):
    dtype = keras.backend.standardize_dtype(g.dtype)
    if inverse is None:
        return g if keep_dtype or dtype == "float32" else ops.cast(g, "float32")
    if dtype == "float32":
        return ops.multiply(g, inverse)
    unscaled = ops.multiply(ops.cast(g, "float32"), inverse)
    return ops.cast(unscaled, dtype) if keep_dtype else unscaled
