"""Keras callbacks for mixed-precision training."""

from keras_mp._src.model.callbacks import OverflowGuard

__all__ = ["OverflowGuard"]
