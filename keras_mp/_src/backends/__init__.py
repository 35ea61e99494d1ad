"""Each Keras backend's execution model, behind the one switch on the backend.

`current` is the module for this process's Keras backend (fixed per
process): `tensorflow`, `jax` or `torch`, each starting from the portable
hooks of `common` and replacing what its execution model does differently:
the step (`apply`, `run_stateless`), the finiteness check and unscaling, the
values logged by `fit`, the checks at `compile`, the doctor's gradients, the
device probes, and the train step's program as the compiled census reads it
(`hlo_text`, `tf_graph`, `torch_dispatch`). A backend Keras has but keras_mp
does not train on gets `common`, whose step says so. Beside them, the
devices' rates: this CPU's measured (`cpu_rates`), the GPUs' peaks and a
CPU's as the same `Peaks` (`gpu_peaks`).

The backend modules receive the step's state and callables
(`loss_scale.Step`) and never import the optimizer.
"""

import importlib

import keras

_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}

current = importlib.import_module(f"{__name__}.{_MODULES.get(keras.backend.backend(), 'common')}")
