"""Imports Keras without TensorFlow's C++ start-up lines (for the examples).

TensorFlow 2.21 writes them to the process's stderr before its log level
(`TF_CPP_MIN_LOG_LEVEL`) applies, so stderr is closed while it loads; later
messages follow `TF_CPP_MIN_LOG_LEVEL`, set here to errors only unless you
set it yourself.
"""

import os


def import_keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import keras  # noqa: F401

        try:
            # Loaded here, not later: on every backend Keras's data
            # pipeline (and export) use TensorFlow where it is installed.
            import tensorflow  # noqa: F401
        except ImportError:
            pass
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
