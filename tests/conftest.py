"""Test set-up shared by every backend (one backend per pytest process)."""

import os

# Import torch before TensorFlow/JAX when it is the backend: importing it
# after them can pick up conflicting OpenMP runtimes.
if os.environ.get("KERAS_BACKEND") == "torch":
    import torch

    # References are float32/float64 runs: TF32 matmuls would blur them.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_global_dtype_policy():
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"
