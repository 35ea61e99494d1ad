"""What this machine's CPU does with each dtype, measured once per process.

Whether bfloat16 is faster than float32 on a CPU depends on the processor
(AVX512-BF16 on AMD Zen 4 and Intel Cooper Lake, AMX on Sapphire Rapids and
later; emulated elsewhere) and on what the backend compiles a matmul to
(oneDNN for TensorFlow and PyTorch, XLA's own CPU emitter for JAX). Flags
say what the processor has, not what the backend does with it, so
`amp_level="auto"` and the speed report time it: one matmul in each dtype
at a size models train at (1024 x 1024 x 1024: BERT-base's projections at
128 tokens and batch 8), run the way `fit` runs a step's matmuls on this
backend (`timed_ops.matmul`), the fastest of a few runs after
a warm-up (noise only slows a run down: on a 2-core virtual machine the
median of five moved by 15 % between processes). A dtype costs at most a
few tenths of a second, once per process: one the backend emulates slowly
(PyTorch's bfloat16 without native instructions: about 1 GFLOP/s) is timed
at `PROBE_SIZE` only.

A CPU whose flags name no native instructions for a half dtype converts it
to float32 to multiply: its matmul is never faster than float32's there,
whatever one timing says (a 1024 matmul's float32 rate varied from 78 to
142 GFLOP/s between processes on a 2-core AMD EPYC without AVX512-BF16,
so its bfloat16 once timed 1.28x float32's while BERT trained 0.87x as
fast): `amp_level="auto"` reads the flags first (`auto_level.py`).

A step is more than its matmuls: `elementwise_rate` times one elementwise
op on 4M values in each dtype as the backend runs it (a CPU computes most
half elementwise ops by converting to float32: they need not be faster
than float32's), and `launch_seconds` what a step costs beyond its
arithmetic, per launch as `precision/step_cost.py` counts them: a proxy of
`PROXY_DEPTH` Dense(8) layers with Adam, whose arithmetic takes
microseconds, trained with `train_on_batch` at O0 (float32) and at O2 in
each half dtype, in turns, the fastest of its steps over its `PROXY_LAUNCHES`. It folds
in all that a level adds to a small step (the casts, the loss scale's
check, the skip, half small matmuls that miss the fast path), which is
why a 64-wide MLP trains slower at O2 bfloat16 than at O0 on a CPU whose
1024 matmul is 2.5x faster in bfloat16.
"""

import functools
import os
import threading
import time

import numpy as np

from keras_mp._src.backends import timed_ops

# The matmul's size (m = k = n), and the probe's, timed first: a dtype
# whose probe says the full size would take longer than PROBE_LIMIT_SECONDS
# a run keeps the probe's rate.
SIZE = 1024
PROBE_SIZE = 512
PROBE_LIMIT_SECONDS = 0.25
# Each dtype runs at least MIN_RUNS times after its warm-up, and stops after
# MAX_RUNS or once its runs took BUDGET_SECONDS.
MIN_RUNS = 2
MAX_RUNS = 5
BUDGET_SECONDS = 0.15
# The elementwise op's size (4M values: a BERT's feed-forward activations
# at 128 tokens and batch 16); its runs as the matmul's.
ELEMENTWISE_SIZE = 2**22
# The proxy of `launch_seconds`, and its launches a step as
# `step_cost.launches` counts them (each Dense 3 and one per variable; at
# O2 also the casts: the kernels, biases, the first input and the float32
# output, forward and back).
PROXY_DEPTH = 4
PROXY_WIDTH = 8
PROXY_LAUNCHES = {"float32": 20, "half": 40}
PROXY_STEPS = 50
PROXY_BUDGET_SECONDS = 0.3
# The CPU flags of native half matmul instructions (x86's, then Arm's).
NATIVE = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "asimdhp"),
}


_LOCK = threading.Lock()
_RATES = {}


def matmul_rate(dtype):
    """FLOP/s of a `SIZE`-cubed matmul in `dtype` on this CPU with this
    process's backend (measured on the first call, then cached; threads
    compiling at once share one measurement, taken alone)."""
    with _LOCK:
        if dtype not in _RATES:
            _RATES[dtype] = _measure(dtype)
        return _RATES[dtype]


def _measure(dtype):
    if dtype != "float32":
        # A half dtype the backend emulates (PyTorch's bfloat16 without
        # AVX512-BF16: about 1 GFLOP/s) keeps the probe's rate. float32 is
        # never probed, and the probe is 512: a fixed cost per call (threads
        # waking on a loaded machine: ~16 ms) makes a small matmul read far
        # too low (a native 300 GFLOP/s read 2 at 256, 16 at 512: still
        # timed in full; the emulated 1.2 still kept).
        probe = _rate(PROBE_SIZE, dtype)
        if 2 * SIZE**3 / probe > PROBE_LIMIT_SECONDS:
            return probe
    return _rate(SIZE, dtype)


def _rate(size, dtype):
    return 2 * size**3 / _fastest(timed_ops.matmul(size, dtype))


def elementwise_rate(dtype):
    """Values a second one elementwise op computes in `dtype` on this CPU
    with this process's backend (measured once, then cached)."""
    return _cached(("elementwise", dtype), lambda: _elementwise(dtype))


def launch_seconds(dtype):
    """Seconds a step costs beyond its arithmetic, per launch, at O0
    (`"float32"`) or at O2 in the half `dtype`, with this process's backend
    (the proxy's steps, measured once, then cached); None where the proxy
    cannot train in this process. The proxies of O0 and of both half dtypes
    are timed in turns, so that a machine's load weighs on each alike:
    their ratios are what `auto` decides from."""
    steps = _cached("launch", _proxy_steps)
    return None if steps is None else steps[dtype]


def _cached(key, measure):
    with _LOCK:
        if key not in _RATES:
            _RATES[key] = measure()
        return _RATES[key]


def _elementwise(dtype):
    run = timed_ops.elementwise(ELEMENTWISE_SIZE, dtype)
    return ELEMENTWISE_SIZE / _fastest(run)


def _fastest(run, most=MAX_RUNS, budget=BUDGET_SECONDS):
    run()  # Compiles it, and warms the caches.
    seconds = []
    while len(seconds) < MIN_RUNS or (len(seconds) < most and sum(seconds) < budget):
        if seconds and seconds[0] > budget:
            break  # one run is the budget: an emulated dtype times once
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def proxy_model():
    """The proxy `launch_seconds` trains: `PROXY_DEPTH` Dense layers of
    `PROXY_WIDTH`, named, and constant (the user's layer names and random
    draws stay as they would be without it)."""
    import keras

    constant = keras.initializers.Constant(0.01)
    return keras.Sequential(
        [keras.Input((PROXY_WIDTH,), name="keras_mp_proxy_input")]
        + [
            keras.layers.Dense(
                PROXY_WIDTH,
                kernel_initializer=constant,
                dtype="float32",  # whatever the global policy
                name=f"keras_mp_proxy_{i}",
            )
            for i in range(PROXY_DEPTH)
        ],
        name="keras_mp_launch_proxy",
    )


def _proxy_steps():
    """`{dtype: per-launch seconds}` of the proxy at O0 (`"float32"`) and at
    O2 in each half dtype, timed in turns."""
    try:
        runs = {dtype: _proxy_step(dtype) for dtype in ("float32", "bfloat16", "float16")}
        best = _fastest_in_turns(runs, PROXY_STEPS, PROXY_BUDGET_SECONDS)
    except Exception:  # A step this process cannot run (a distribution that
        return None  # shards the batch of 8 over its devices): not known.
    return {
        dtype: seconds / PROXY_LAUNCHES["float32" if dtype == "float32" else "half"]
        for dtype, seconds in best.items()
    }


def _proxy_step(dtype):
    """A step of the proxy at O0 (`"float32"`) or O2 in `dtype`, compiled."""
    import keras

    model = proxy_model()
    # keras_mp's own `compile` (installed with it): the level's whole step.
    level = {} if dtype == "float32" else {"amp_level": "O2", "amp_dtype": dtype}
    model.compile(optimizer=keras.optimizers.Adam(1e-9), loss="mse", **level)
    x = np.ones((PROXY_WIDTH, PROXY_WIDTH), "float32")
    return lambda: model.train_on_batch(x, x)


def _fastest_in_turns(runs, most, budget):
    """`{name: fastest seconds}` of `runs` (`{name: callable}`), each run
    once to compile, then in turns, `most` rounds or `budget` seconds."""
    for run in runs.values():
        run()
    seconds = {name: [] for name in runs}
    start_all = time.perf_counter()
    for _ in range(most):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
        if time.perf_counter() - start_all > budget and len(seconds[name]) >= MIN_RUNS:
            break
    return {name: min(times) for name, times in seconds.items()}


@functools.cache
def memory_bandwidth():
    """Bytes/s a 64 MiB copy reads and writes on this machine's memory."""
    source = np.ones(16 * 2**20, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(target, source)
        seconds.append(time.perf_counter() - start)
    return 2 * source.nbytes / min(seconds)


@functools.cache
def cpu_flags():
    """The flags of /proc/cpuinfo (an empty set where there is none)."""
    return frozenset((_cpuinfo(("flags", "Features")) or "").split())


def native(flags, dtype):
    """The flags among `flags` of native `dtype` matmul instructions, sorted."""
    return sorted(set(flags) & set(NATIVE.get(dtype, ())))


# `KERAS_MP_TIED_HEAD`: "half" or "float32" forces how a layer that does not
# autocast reads its weights when it multiplies half inputs
# (`boundaries.py`); unset or "auto", by the device (`tables_in_half`).
TIED_HEAD_ENV = "KERAS_MP_TIED_HEAD"
TIED_HEAD_FORMS = ("auto", "half", "float32")


def tables_in_half(dtype, native=None):
    """Whether a layer that does not autocast (a tied embedding read in
    reverse: a language model's logits) reads its float32 weights in the
    half `dtype` of its inputs to multiply them, or in float32 as Keras's
    own policies read them.

    In half wherever half matmuls compute in half: a GPU's or TPU's tensor
    cores, a CPU with native instructions for `dtype`. A CPU without them
    converts both operands to float32 to multiply (TensorFlow's oneDNN and
    PyTorch: a third to a fifth of float32's rate), so the table is read
    in float32 there, the largest matmul of a language model's step at
    float32's rate, its logits the float32 values Keras's TensorFlow and
    PyTorch `mixed_bfloat16` compute (Keras's JAX reads the table in half
    under the model's autocast scope). `KERAS_MP_TIED_HEAD` ("half", "float32")
    forces one form on every device (the tests pin "half").

    `native`: whether the device in question multiplies `dtype` natively
    (a CPU the speed report prices); None: this process's device.
    """
    form = tied_head_form()
    if form != "auto":
        return form == "half"
    return not half_matmuls_converted(dtype) if native is None else native


def tied_head_form():
    """`KERAS_MP_TIED_HEAD`'s form: "auto" (unset), "half" or "float32";
    any other value is an error naming the variable (`amp_settings` checks
    it with `apply_amp`'s and `compile`'s arguments, before anything
    changes)."""
    form = os.environ.get(TIED_HEAD_ENV, "auto").strip().lower() or "auto"
    if form not in TIED_HEAD_FORMS:
        raise ValueError(
            f"The environment variable {TIED_HEAD_ENV} must be one of "
            f"{', '.join(repr(f) for f in TIED_HEAD_FORMS)}. Received: {form!r}"
        )
    return form


def half_matmuls_converted(dtype):
    """Whether this process's matmuls in the half `dtype` are converted to
    float32 to multiply: on a CPU (no GPU or TPU in use) whose flags name no
    native instructions for `dtype`, or whose backend computes no matmul in
    it (`computes_half_matmuls`: PyTorch's float16 on a CPU)."""
    from keras_mp._src import backends

    if not runs_on_a_cpu():
        return False
    flags = cpu_flags()
    if flags and not native(flags, dtype):
        return True
    return not backends.current.computes_half_matmuls(dtype)


@functools.cache
def runs_on_a_cpu():
    """Whether this process's backend computes on a CPU: no GPU (as each
    backend sees one), and no TPU."""
    from keras_mp._src import backends

    try:
        if backends.current.gpu_name():
            return False
    except Exception:  # No usable GPU runtime.
        pass
    if backends.current.NAME == "jax":
        import jax

        return jax.default_backend() == "cpu"
    if backends.current.NAME == "tensorflow":
        import tensorflow as tf

        return not tf.config.list_logical_devices("TPU")
    return True


@functools.cache
def cpu_name():
    """The processor's model name, or "this CPU"."""
    return _cpuinfo(("model name",)) or "this CPU"


def _cpuinfo(keys):
    """The value of /proc/cpuinfo's first line starting with one of `keys`,
    or None (no such line, or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
