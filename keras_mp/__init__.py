"""keras_mp: mixed-precision training for Keras 3.

The public API, in full (implementation lives in `keras_mp._src`):
"""

from keras_mp._src.loss_scale_optimizer import LossScaleOptimizer

__version__ = "0.1.0"

__all__ = [
    "LossScaleOptimizer",
]
