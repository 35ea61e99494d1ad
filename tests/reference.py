"""An executable pure-Python (NumPy float32) model of the loss-scale step.

Written from the contract (API.md section 1), not from the implementation, so
tests compare the optimizer against an independent statement of the rules.
Powers of two and float32 products are exact here and on every backend, so
comparisons are exact.
"""

import numpy as np

f32 = np.float32
# The contract's "no floor" still keeps the scale a normal float32 (never 0).
SMALLEST_NORMAL = f32(np.finfo(np.float32).tiny)


class ReferenceLossScale:
    def __init__(
        self,
        dynamic=True,
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=None,
        max_scale=2.0**24,
        skip_on_overflow=True,
    ):
        self.dynamic = dynamic
        self.scale = f32(initial_scale)
        self.dynamic_growth_steps = dynamic_growth_steps
        self.growth_factor = f32(growth_factor)
        self.backoff_factor = f32(backoff_factor)
        self.floor = SMALLEST_NORMAL if min_scale is None else f32(min_scale)
        self.max_scale = f32(max_scale)
        self.skip_on_overflow = skip_on_overflow
        self.good_steps = 0
        self.skipped_steps = 0
        self.iterations = 0

    def step(self, grads):
        """Advances one step; returns whether the update is applied.

        `grads` is a list of NumPy arrays (the gradients of the scaled loss).
        """
        checks = self.dynamic or self.skip_on_overflow
        finite = all(np.all(np.isfinite(g)) for g in grads)
        if checks and not finite:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale = max(f32(self.scale * self.backoff_factor), self.floor)
            return False
        self.iterations += 1
        self.good_steps += 1
        if self.dynamic and self.good_steps == self.dynamic_growth_steps:
            self.scale = min(f32(self.scale * self.growth_factor), self.max_scale)
            self.good_steps = 0
        return True


def reference_sgd_step(weights, grads, scale, learning_rate):
    """Plain SGD on unscaled gradients, in float32: w - lr * (g * (1 / scale)).

    Unscaling multiplies by the float32 reciprocal of the scale, as
    `torch.amp.GradScaler` does (the same as dividing for a power-of-two
    scale; within one rounding otherwise).
    """
    inverse = f32(1) / f32(scale)
    return [
        (w - f32(learning_rate) * (g.astype(f32) * inverse)).astype(w.dtype)
        for w, g in zip(weights, grads)
    ]
