"""Why a run's steps keep being skipped, and what to do, told from its scale.

A LossScaleOptimizer skips a step whose gradients (or loss) are not finite.
Where its scale stands says which cause is left, so `OverflowGuard` and the
warning of a mostly-skipped run (`callbacks.SkippedStepsWarning`) give the
advice that fits it:

- a dynamic scale at the floor of the user's `min_scale`: the gradients
  need a smaller scale than the floor allows (a loss on a large scale, such
  as a regression on unnormalised targets); a lower learning rate or
  `clipnorm` would not help, `min_scale=None` would;
- a dynamic scale at its lowest (2**-126, with no `min_scale`): no scale
  makes the step finite, so the forward pass or the loss itself is not
  (NaN in the data, values past the half dtype's range, a diverged run);
- a fixed scale: it may be too large for the gradients (a dynamic one finds
  theirs), or a fixed 1 (O3's, bfloat16's check) with non-finite values in
  the forward pass;
- a dynamic scale still backing off: at the start of a run it is finding
  its level; if it keeps falling, both of the above.
"""

from keras_mp._src.optimizer.loss_scale import MIN_SCALE

_TARGETS = (
    "Gradients this large usually come from a loss on a large scale, such "
    "as a regression on unnormalised targets (prices): normalize the targets "
    "(subtract their mean, divide by their standard deviation, and scale the "
    "predictions back), which also keeps float16's precision."
)

_FORWARD = (
    "Check the data for NaN/inf. Values past float16's range (65504) in "
    "the forward pass, such as a regression's outputs on targets of a large "
    "scale: normalize the targets, or keep the layers that overflow in "
    "float32 (`keras_mp.analyze(model, x, y)` names them; `amp_deny=[...]`, "
    "e.g. the regression head), or train in bfloat16 "
    "(`amp_dtype='bfloat16'`), which has float32's range. A run that "
    "diverged: a lower learning rate, or `clipnorm` on the inner optimizer."
)


def scale_text(scale):
    """`2**-126` for the lowest scale, else the number."""
    return "2**-126" if scale <= MIN_SCALE else f"{scale:g}"


def at_floor(optimizer, scale):
    """Whether a dynamic scale can back off no further."""
    return optimizer.dynamic and scale <= optimizer.config.floor


def diagnosis(optimizer, scale):
    """`(cause, advice)`: why `optimizer`'s steps keep being skipped, with
    its scale at `scale`, and what to do about it (sentences)."""
    if not optimizer.dynamic:
        if optimizer.initial_scale == 1.0:
            return (
                "the loss or its gradients are not finite with nothing scaled "
                "(a fixed loss scale of 1)",
                "In float16, a dynamic loss scale (`loss_scale='dynamic'`) "
                "goes below 1 where the gradients overflow at 1. " + _FORWARD,
            )
        return (
            f"the fixed loss scale {scale:g} may be too large for these gradients",
            "A dynamic scale (`loss_scale='dynamic'`, or `dynamic=True`) "
            "finds the one they need, or use a smaller fixed one. " + _FORWARD,
        )
    if at_floor(optimizer, scale) and optimizer.min_scale is not None:
        return (
            "the gradients overflow float16 even at the lowest scale that "
            f"min_scale={optimizer.min_scale:g} allows",
            "Let the scale go as low as they need: `min_scale=None` (no floor, "
            "as Keras 3 and torch.amp.GradScaler) or a smaller `min_scale`; a "
            "lower learning rate or `clipnorm` does not help. " + _TARGETS,
        )
    if at_floor(optimizer, scale):
        return (
            "no loss scale makes the steps finite, down to 2**-126 (the "
            "lowest, with no `min_scale`): the loss or the forward pass "
            "itself is not finite",
            _FORWARD,
        )
    return (
        f"the dynamic loss scale backs off at each skipped step (now {scale_text(scale)})",
        "At the start of a run it is finding the scale the gradients need "
        f"(each skip multiplies it by {optimizer.backoff_factor:g}; a larger "
        "`patience` lets `OverflowGuard` wait for it); "
        "if it keeps falling, the gradients are past float16's range at any "
        "scale it has tried. " + _TARGETS + " " + _FORWARD,
    )
