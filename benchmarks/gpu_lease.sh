#!/bin/bash
# One lease's device work (issue 66), as the background job of a 15-minute lease.
#
# The lease's first call carries the keras wheels (.whl) and the kit's
# unpack.sh, starts this script with setsid and returns; the next calls carry
# the pieces of TensorFlow's GPU kit (../shared/tools/tf-gpu-kit), one a call,
# while this script measures JAX and PyTorch. Then TensorFlow, then the test
# suite on all three backends for what time is left. Each step writes its log
# to $LEASE/NAME.log and lines to $LEASE/status; the last call collects them.
#
#     setsid nohup bash benchmarks/gpu_lease.sh > /tmp/lease.out 2>&1 < /dev/null &
#
# The measuring processes share the GPU: they compile side by side and take
# turns on the clock (real_models.py --lock: the warm epoch, the timed rounds
# and the kernel profiles hold one file lock), so that no two time at once.
# TensorFlow's ResNet50 waits for PyTorch's (five processes together ran an
# 80 GB H100 out of memory on 2026-11-27). Every job ends by BENCH_END
# seconds from the start; the suite runs from then to TESTS_END, each
# backend's failures of the last lease (.lease_in/failed_BACKEND.txt) first.
set -u
cd "$(dirname "$0")/.."
LEASE=${LEASE:-/tmp/lease}
PIECES=${PIECES:-15}
ROUNDS=${ROUNDS:-5}
COMPILE_FOR=${COMPILE_FOR:-300} # seconds a job may spend compiling before it times what it has
BENCH_END=${BENCH_END:-420}     # seconds from the start at which every measuring job ends
TESTS_END=${TESTS_END:-640}     # ... and the test suite
mkdir -p "$LEASE"
cp -r .lease_in "$LEASE/in" 2> /dev/null # the last lease's failures, read at the end
START=$(date +%s)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_FORCE_GPU_ALLOW_GROWTH=true
export TF_CPP_MIN_LOG_LEVEL=2
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/keras-mp-site \
    .whl/*.whl > "$LEASE/install.log" 2>&1
export PYTHONPATH="$PWD:/tmp/keras-mp-site"
LOCK="$LEASE/gpu.lock"
note() { echo "=== $* $(($(date +%s) - START))s" >> "$LEASE/status"; }
left() { # seconds of compiling left (at least 30: each job times something)
    local t=$((COMPILE_FOR - ($(date +%s) - START)))
    echo $((t > 30 ? t : 30))
}

until_() { # seconds from now to $1 seconds from the start (at least 10)
    local t=$(($1 - ($(date +%s) - START)))
    echo $((t > 10 ? t : 10))
}
step() {
    local name=$1
    shift
    note "$name"
    (cd benchmarks && timeout "$(until_ "$BENCH_END")" "$@") > "$LEASE/$name.log" 2>&1
    note "$name rc=$?"
}
dump() { echo "--xla_dump_to=/tmp/dump_$1 --xla_dump_hlo_as_text ${2:-}"; }
JAX_MODULES="--xla_dump_hlo_module_re=.*train_step.*"
real() { # NAME BACKEND [ENV...] -- ARGS...: real_models.py, timed in turns
    local name=$1 backend=$2
    shift 2
    step "$name" env KERAS_BACKEND="$backend" "$@" ${TINY:-} --rounds "$ROUNDS" --lock "$LOCK" \
        --compile-for "$(left)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LEASE/status" 2>&1
after() { # waits for the jobs named to end
    local job
    for job in "$@"; do
        while [ ! -e "$LEASE/$job.done" ]; do sleep 2; done
    done
}
(
    # FP8: which forms of a matmul XLA rewrites into FP8 GEMMs (the last
    # lease's O2 float8 ran none); then the Gemma's memory as XLA plans it.
    step fp8_probe env KERAS_BACKEND=jax python3 fp8_probe.py
    step jax_memory env KERAS_BACKEND=jax python3 real_models.py --models gemma \
        --planned-memory 16 32 --compile-for "$(left)" \
        --configs O0 "O2 bfloat16" "O3 bfloat16" "keras mixed_bfloat16" "O2 float8"
    # The BERT's kept probabilities take the common form on a GPU (the
    # barrier and reduce_precision are the CPU's): does XLA's GPU hold them
    # in half, as Keras's policy's? (issue 65, on a CPU 461 against 458 MiB)
    step jax_bert_memory env KERAS_BACKEND=jax python3 memory_census.py --models bert \
        --configs "O2 bfloat16" "O3 bfloat16" "keras mixed_bfloat16"
    touch "$LEASE/jax.done"
) &
(
    # keras_mp's O2 took 1.10-1.24x Keras's step here (2026-11-27): the kernels of both.
    real torch torch python3 real_models.py --models resnet50 --configs O0 "O0 float32" \
        "O2 float16" "O2 bfloat16" "O3 bfloat16" "keras mixed_float16" "keras mixed_bfloat16" \
        --profile "O2 float16" "keras mixed_float16"
    touch "$LEASE/torch.done"
) &
(
    # TensorFlow: its kit's pieces arrive one per call of the lease.
    for _ in $(seq 1 150); do
        [ "$(ls /tmp/tfkit/[0-9]* 2> /dev/null | wc -l)" -ge "$PIECES" ] && break
        sleep 2
    done
    note "tf_kit $(ls /tmp/tfkit/[0-9]* 2> /dev/null | wc -l) pieces"
    # The device image has no zstd command: Python's zstandard (a carried wheel) unpacks.
    if ! command -v zstd > /dev/null && [ ! -d /tmp/tfgpu/site ]; then
        cat $(ls /tmp/tfkit/[0-9]* | sort) | python3 -c "import sys, zstandard
zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" | tar -C /tmp -xf -
    fi
    if bash /tmp/tfkit/unpack.sh > "$LEASE/tf_unpack.log" 2>&1; then
        note "tf_kit unpacked"
        . /tmp/tfgpu/env.sh
        export TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD:/tmp/keras-mp-site:$PYTHONPATH"
        # Three processes compile side by side (TensorFlow's XLA compiles a
        # Gemma's step in about a minute): each pair to compare in one.
        real tf_gemma_bf16 tensorflow python3 real_models.py --models gemma \
            --configs O0 "O2 bfloat16" "keras mixed_bfloat16" &
        real tf_gemma_f16 tensorflow XLA_FLAGS="${XLA_FLAGS:-} $(dump tf_gemma_f16)" \
            python3 real_models.py --models gemma \
            --configs "O2 float16" "keras mixed_float16" "O3 bfloat16" "O2 float8" &
        after torch
        real tf_resnet tensorflow python3 real_models.py --models resnet50 \
            --configs O0 "O2 float16" "keras mixed_float16" "O2 bfloat16" "keras mixed_bfloat16"
        wait
    fi
    touch "$LEASE/tf.done"
) &
wait
note "benchmarks done"

# The test suite on the GPU, the three backends side by side until
# TESTS_END: first each backend's failures of the last lease, then the rest
# (-v: a run cut short still names its failures; _report_failures writes
# each failure's traceback as it happens).
tests() {
    local b=$1 first=$LEASE/in/failed_$1.txt
    local run="import sys, pytest
first = [l for l in open(sys.argv[1]).read().splitlines() if l] if sys.argv[1] else []
args = ['-v', '--tb=short', '-p', 'no:cacheprovider', '-p', 'no:benchmark', '-p', '_report_failures']
if sys.argv[2] == 'first':
    sys.exit(pytest.main(['-n', '4', *args, *first]) if first else 0)
sys.exit(pytest.main(['-n', '4', *args, *('--deselect=' + i for i in first), 'tests']))"
    [ -e "$first" ] || first=""
    export KERAS_BACKEND=$b FAILURES_LOG="$LEASE/failures_$b.log"
    export PYTHONPATH="$PWD/benchmarks:$PYTHONPATH"
    # JAX's and PyTorch's suites import TensorFlow as CI's environment has it
    # (tf.data for KerasHub's fit, Keras's Hashing, TensorBoard): the kit's,
    # last on the path and without its CUDA 12 libraries, on the CPU.
    if [ "$b" != tensorflow ] && [ -d /tmp/tfgpu/site ]; then
        export PYTHONPATH="$PYTHONPATH:/tmp/tfgpu/site"
    fi
    timeout "$(until_ "$TESTS_END")" python3 -c "$run" "$first" first > "$LEASE/tests_first_$b.log" 2>&1
    note "tests_first_$b rc=$?"
    timeout "$(until_ "$TESTS_END")" python3 -c "$run" "$first" rest > "$LEASE/tests_$b.log" 2>&1
    note "tests_$b rc=$?"
}
tests jax &
tests torch &
if [ -e /tmp/tfgpu/env.sh ]; then
    (. /tmp/tfgpu/env.sh && export PYTHONPATH="$PWD:/tmp/keras-mp-site:$PYTHONPATH" \
        && tests tensorflow) &
fi
wait
note "done"
