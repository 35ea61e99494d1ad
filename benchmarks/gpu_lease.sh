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
# At most three processes share the GPU; on a GPU of less than 100 GiB the
# 1B Gemma waits for the other jobs to end.
set -u
cd "$(dirname "$0")/.."
LEASE=${LEASE:-/tmp/lease}
PIECES=${PIECES:-15}
ROUNDS=${ROUNDS:-5}
COMPILE_FOR=${COMPILE_FOR:-330} # seconds a job may spend compiling before it times what it has
TESTS_FOR=${TESTS_FOR:-150}     # seconds of the test suite, per backend, side by side
mkdir -p "$LEASE"
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

step() {
    local limit=$1 name=$2
    shift 2
    note "$name"
    (cd benchmarks && timeout "$limit" "$@") > "$LEASE/$name.log" 2>&1
    note "$name rc=$?"
}
dump() { echo "--xla_dump_to=/tmp/dump_$1 --xla_dump_hlo_as_text ${2:-}"; }
JAX_MODULES="--xla_dump_hlo_module_re=.*train_step.*"
real() { # NAME BACKEND [ENV...] -- ARGS...: real_models.py, timed in turns
    local name=$1 backend=$2
    shift 2
    step 600 "$name" env KERAS_BACKEND="$backend" "$@" ${TINY:-} --rounds "$ROUNDS" --lock "$LOCK" \
        --compile-for "$(left)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LEASE/status" 2>&1
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
GEMMA=(O0 "O0 float32" "O2 float16" "O2 bfloat16" "O3 bfloat16" "keras mixed_float16"
    "keras mixed_bfloat16" "O2 float8")
RESNET=(O0 "O0 float32" "O2 float16" "O2 bfloat16" "O3 bfloat16" "keras mixed_float16"
    "keras mixed_bfloat16")
# TensorFlow starts last (its kit arrives in pieces): strict float32 is JAX's and PyTorch's.
TF_GEMMA=(O0 "O2 float16" "O2 bfloat16" "O3 bfloat16" "keras mixed_float16" "keras mixed_bfloat16"
    "O2 float8")
TF_RESNET=(O0 "O2 float16" "O2 bfloat16" "keras mixed_float16" "keras mixed_bfloat16")

after() { # waits for the jobs named to end
    local job
    for job in "$@"; do
        while [ ! -e "$LEASE/$job.done" ]; do sleep 2; done
    done
}
# Three streams share the GPU at most (2026-11-27: five processes on an
# 80 GB H100 ran out of memory, and TensorFlow's allocator aborted).
(
    real jax_gemma jax XLA_FLAGS="$(dump jax_gemma "$JAX_MODULES")" \
        python3 real_models.py --models gemma --configs "${GEMMA[@]}"
    real jax_resnet jax XLA_FLAGS="$(dump jax_resnet "$JAX_MODULES")" \
        python3 real_models.py --models resnet50 --configs "${RESNET[@]}" \
        --profile "O2 float16" "keras mixed_float16"
    touch "$LEASE/jax.done"
) &
(
    real torch torch python3 real_models.py --models gemma resnet50 --configs "${RESNET[@]}"
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
        real tf_gemma tensorflow XLA_FLAGS="${XLA_FLAGS:-} $(dump tf_gemma)" python3 \
            real_models.py --models gemma --configs "${TF_GEMMA[@]}"
        after torch
        real tf_resnet tensorflow XLA_FLAGS="${XLA_FLAGS:-} $(dump tf_resnet)" python3 \
            real_models.py --models resnet50 --configs "${TF_RESNET[@]}"
    fi
    touch "$LEASE/tf.done"
) &
(
    # FP8 where it pays: a 1B Gemma, O2 float8 (and its FP8 moments) against
    # O2 bfloat16. Its three configurations hold ~35 GiB between steps: on a
    # GPU of less than 100 GiB it waits for the other jobs to end.
    if [ "${MEM_MIB:-0}" -lt 100000 ]; then after jax torch tf; else after jax; fi
    COMPILE_FOR=$(($(date +%s) - START + ${COMPILE_1B:-200}))
    real jax_gemma1b jax XLA_FLAGS="$(dump jax_gemma1b "$JAX_MODULES")" \
        python3 real_models.py --models gemma1b --configs "O2 bfloat16" "O2 float8" \
        "O2 float8 +moments"
) &
wait
note "benchmarks done"

# The test suite on the GPU, the three backends side by side for TESTS_FOR
# seconds each (-v: a run cut short still names its failures).
tests() {
    local b=$1
    # _report_failures: each failure's traceback as it happens (a suite cut
    # short by its time limit prints no summary).
    KERAS_BACKEND=$b FAILURES_LOG="$LEASE/failures_$b.log" PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" \
        timeout "$TESTS_FOR" python3 -m pytest -n "${JOBS:-5}" -v --tb=short -rfE \
        -p no:cacheprovider -p no:benchmark -p _report_failures tests > "$LEASE/tests_$b.log" 2>&1
    note "tests_$b rc=$?"
}
if [ "${TESTS_FOR}" -gt 0 ]; then
    tests jax &
    tests torch &
    if [ -e /tmp/tfgpu/env.sh ]; then
        (. /tmp/tfgpu/env.sh && export PYTHONPATH="$PWD:/tmp/keras-mp-site:$PYTHONPATH" \
            && tests tensorflow) &
    fi
    wait
fi
note "done"
