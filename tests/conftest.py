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
# A tied head reads its table in half on every machine, whatever its CPU's
# flags (`cpu_rates.tables_in_half`): the same programs on CI's machines and
# yours; its float32 form has its own tests.
os.environ.setdefault("KERAS_MP_TIED_HEAD", "half")

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


# -- which backend proves what, and where the time goes -------------------------

# A property that does not depend on the backend (a rule's decision, a
# table, a parser, a report's arithmetic, the state machine's reference) is
# proven once, on the backend whose steps cost least on a CPU: PyTorch's run
# op by op, where TensorFlow and JAX compile (CONTRIBUTING.md, "Which
# backend proves what").
ONE_BACKEND = "torch"
# A test whose call takes longer than this carries `@pytest.mark.slow(reason=...)`;
# the summary lists the ones that do not, and what the marked ones cost.
SLOW_SECONDS = 30.0


def pytest_collection_modifyitems(config, items):
    # The tests marked slow first (a stable sort: the rest keep their
    # order, modules together): one that starts last holds a worker while
    # the other idles, minutes of CI's time.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        marker = item.get_closest_marker("one_backend")
        if marker is None:
            continue
        backend = marker.args[0] if marker.args else ONE_BACKEND
        if keras.backend.backend() != backend:
            item.add_marker(pytest.mark.skip(reason=f"backend-independent: proven on {backend}"))


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("slow")
    if marker is not None and not (marker.kwargs.get("reason") or marker.args):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs reason=...")


def pytest_terminal_summary(terminalreporter):
    """The tests over `SLOW_SECONDS`: the marked ones' total, and the ones
    that carry no reason for their time (each a place to cut)."""
    marked, unmarked = [], []
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get(
        "failed", []
    ):
        if report.when != "call":
            continue
        if "slow" in report.keywords:
            marked.append(report)
        elif report.duration > SLOW_SECONDS:
            unmarked.append(report)
    terminalreporter.write_sep("-", f"tests over {SLOW_SECONDS:.0f} s")
    total = sum(r.duration for r in marked)
    terminalreporter.write_line(
        f"marked slow (with a reason): {len(marked)} tests, {total:.0f} s in all"
    )
    for report in sorted(unmarked, key=lambda r: -r.duration):
        terminalreporter.write_line(
            f"over {SLOW_SECONDS:.0f} s without @pytest.mark.slow(reason=...): "
            f"{report.duration:.1f} s {report.nodeid}"
        )
