#!/bin/bash
# One lease's device work (issue 57), as the background job of a 15-minute lease.
#
# The lease's first call carries the keras wheels (.whl) and the first piece of
# TensorFlow's GPU kit, starts this script with setsid and returns; the next
# calls carry the kit's other pieces (../shared/tools/tf-gpu-kit) while this
# script measures JAX. It then waits for the kit, unpacks it and measures
# TensorFlow, then PyTorch. Each step writes its log to $LEASE/NAME.log and a
# line to $LEASE/status; the last call collects them.
#
#     setsid nohup bash benchmarks/gpu_lease.sh > /tmp/lease.out 2>&1 < /dev/null &
#
# Each step is real_models.py (speed-ups beside the speed report's bounds; the
# Gemma's head in half as "+head"; peak memory where the backend can reset it)
# with XLA dumping its modules, so that each configuration's compiled program
# is counted too (hlo_census.matmul_census: matmul FLOPs by dtype as lowered
# and after XLA's GPU passes, and the converts left as kernels of their own).
set -u
cd "$(dirname "$0")/.."
LEASE=${LEASE:-/tmp/lease}
PIECES=${PIECES:-15}
mkdir -p "$LEASE"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_FORCE_GPU_ALLOW_GROWTH=true
export TF_CPP_MIN_LOG_LEVEL=2
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/keras-mp-site \
    .whl/*.whl > "$LEASE/install.log" 2>&1
export PYTHONPATH="$PWD:/tmp/keras-mp-site"

step() {
    local limit=$1 name=$2
    shift 2
    echo "=== $name $(date +%T)" >> "$LEASE/status"
    (cd benchmarks && timeout "$limit" "$@") > "$LEASE/$name.log" 2>&1
    echo "=== $name rc=$? $(date +%T)" >> "$LEASE/status"
}
dump() { echo "--xla_dump_to=/tmp/dump_$1 --xla_dump_hlo_as_text ${2:-}"; }
JAX_MODULES="--xla_dump_hlo_module_re=.*train_step.*"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LEASE/status" 2>&1
has() { [[ " ${STEPS:-jax_gemma jax_resnet tf torch} " == *" $1 "* ]]; }
has jax_gemma && step 240 jax_gemma env KERAS_BACKEND=jax XLA_FLAGS="$(dump jax_gemma "$JAX_MODULES")" \
    python3 real_models.py ${TINY:-} --models gemma --rounds 3 --configs O0 "O0 float32" "O2 float16" \
    "O2 bfloat16" "O2 bfloat16 +head" "keras mixed_bfloat16" "O2 float8" "O2 float8 +moments"
has jax_resnet && step 240 jax_resnet env KERAS_BACKEND=jax XLA_FLAGS="$(dump jax_resnet "$JAX_MODULES")" \
    python3 real_models.py ${TINY:-} --models resnet50 --rounds 3 --configs O0 "O0 float32" "O2 float16" \
    "keras mixed_float16"

# TensorFlow: its kit's pieces arrive one per call of the lease.
for _ in $(seq 1 150); do
    [ "$(ls /tmp/tfkit/[0-9]* 2>/dev/null | wc -l)" -ge "$PIECES" ] && break
    sleep 2
done
echo "=== tf_kit $(ls /tmp/tfkit/[0-9]* 2>/dev/null | wc -l) pieces $(date +%T)" >> "$LEASE/status"
# The device image has no zstd command: Python's zstandard (a carried wheel) unpacks.
if ! command -v zstd > /dev/null && [ ! -d /tmp/tfgpu/site ]; then
    cat $(ls /tmp/tfkit/[0-9]* | sort) | python3 -c "import sys, zstandard
zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" | tar -C /tmp -xf -
fi
has tf && if bash /tmp/tfkit/unpack.sh > "$LEASE/tf_unpack.log" 2>&1; then
    (
        . /tmp/tfgpu/env.sh
        export TF_CPP_MIN_LOG_LEVEL=2
        step 300 tf_gemma_xla env XLA_FLAGS="$XLA_FLAGS $(dump tf_gemma)" python3 real_models.py ${TINY:-} \
            --models gemma --rounds 3 --jit-compile true --configs O0 "O2 bfloat16" \
            "O2 bfloat16 +head" "keras mixed_bfloat16"
        step 200 tf_resnet python3 real_models.py ${TINY:-} --models resnet50 --rounds 3 \
            --jit-compile false --configs O0 "O0 float32" "O2 float16" "keras mixed_float16"
    )
fi
has torch && step 150 torch_gemma env KERAS_BACKEND=torch python3 real_models.py ${TINY:-} --models gemma --rounds 3 \
    --configs O0 "O0 float32" "O2 bfloat16" "O2 bfloat16 +head" "keras mixed_bfloat16"
echo "=== done $(date +%T)" >> "$LEASE/status"
