"""Keras callbacks for mixed-precision training."""

from keras_mp._src.callbacks import OverflowGuard

__all__ = ["OverflowGuard"]
