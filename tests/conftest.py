"""Test set-up shared by every backend (one backend per pytest process)."""

import gc
import os


def _threads_per_worker():
    """The cores each pytest-xdist worker may use, or None outside xdist.

    PyTorch sizes its OpenMP pool to the whole machine: with two workers on
    two cores, four threads share two cores and spin while they wait (the
    digits parity runs took 8x longer beside another worker than alone; the
    whole PyTorch run 392 s against 133 s). TensorFlow's and XLA's pools
    block instead, and limiting them made those runs slower.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // workers)


THREADS = _threads_per_worker()

# Import torch before TensorFlow/JAX when it is the backend: importing it
# after them can pick up conflicting OpenMP runtimes.
if os.environ.get("KERAS_BACKEND") == "torch":
    if THREADS is not None:  # before the import: the examples' subprocesses inherit it
        os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import torch

    if THREADS is not None:
        torch.set_num_threads(THREADS)

    # References are float32/float64 runs: TF32 matmuls would blur them.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() == "jax":
    import jax

    # The same for JAX, whose float32 matmuls on a GPU default to TF32.
    jax.config.update("jax_default_matmul_precision", "float32")
elif keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    # And for TensorFlow, which turns TF32 on by default on Ampere and later.
    tf.config.experimental.enable_tensor_float_32_execution(False)

from keras_mp._src.backends import common as backends_common  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _set_aside_what_earlier_modules_left():
    """After each test module, what is still alive is moved out of the
    garbage collector's sight (`gc.freeze`).

    TensorFlow keeps every traced graph, so a worker's heap grows to millions
    of objects over the suite, and each full collection (Python's own, and
    the `gc.collect()` Keras runs when a layer deletes a variable, 15 times in
    a `quantize("int8")`) walks all of them: 4 s each near the end, a minute
    for one test. Frozen objects are not walked; what is garbage now is freed
    first, and what a test makes is collected as usual.
    """
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _restore_global_dtype_policy():
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)


@pytest.fixture(params=["cond", "select"] if keras.backend.backend() == "jax" else [None])
def jax_skip_form(request, monkeypatch):
    """On JAX, runs a test with each form of the skip: `lax.cond` (a CPU's)
    and selects (a GPU's or TPU's), whatever this machine would choose."""
    if request.param is not None:
        monkeypatch.setenv(backends_common.SKIP_FORM_VARIABLE, request.param)
    return request.param


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"
