"""Keras's `Model`, extended: `compile(amp_level=...)` and everything it
installs (`compile`, `model_hooks`), the optimizers a model holds
(`wrapping`), a built optimizer compiled again at another level
(`recompiled`), the train step's telemetry and guards (`train_step`), the
callbacks (`callbacks`), each layer's precision saved with the model
(`saved_precision`, `config_precision`), half weights a step assigns that no optimizer
trains (`assigned_half`), and saves that never lose the last good file
(`atomic_save`).

May import: `keras_internals`, `backends`, `precision`, `optimizer`.
Never `tools` (`tests/test_style.py` checks it).
"""
