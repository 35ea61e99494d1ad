#!/bin/bash
# The GPU checks and benchmarks of benchmarks/README.md (the GPU tables), in one script.
#
# Run from the repository root on a machine with a GPU and JAX and/or PyTorch
# with CUDA (TensorFlow too, if its GPU build is installed):
#
#     bash benchmarks/gpu.sh                      # every part, in the order below
#     bash benchmarks/gpu.sh overhead levels      # some parts
#
# Parts:
#   sanity     the devices, and a two-epoch O2 fit per backend on the GPU
#   tests      the whole suite per backend (pytest -n $JOBS with pytest-xdist)
#   overhead   lso_overhead.py: keras_mp's optimizer over plain and over Keras's
#   forms      jax_skip_forms.py: ways of writing the skip, in plain JAX
#   levels     amp_levels.py on the GPU-sized models (O0-O3, Keras's policies)
#   census     hlo_census.py (JAX): the compiled train step's launches and copies,
#              O0, O2 and O3 against Keras's policies, on the GPU models
#   masters    master_weights.py: memory and step time of O3's master weights
#              and compensated updates against O0 and O2 (a 9M-weight MLP)
#   profile    step_profile.py (JAX; TensorFlow with XLA): where the step's time
#              goes, by kind of kernel, O0 against O2 and Keras's policies
#   real       real_models.py: ResNet50 (batch 128, 224x224) and a ~100M KerasHub
#              Gemma, O0 (TF32 as set, and off) against O2/O3, with the speed
#              report's bound beside each measured speed-up (REAL_ROUNDS, default 3)
#   real_memory  real_models.py --memory and --max-batch: peak memory per
#              configuration; the largest batch at O0 and O2/O3 (the Gemma)
#   tf_levels  TensorFlow only: every level, float16 and bfloat16, XLA on and off,
#              on ResNet50 and the transformer (needs TensorFlow's GPU build:
#              ../shared/tools/tf-gpu-kit, then `. /tmp/tfgpu/env.sh`)
#
# Environment:
#   BACKENDS   the Keras backends to use (default: "jax torch", plus
#              tensorflow when it sees a GPU)
#   OUT        where the logs go (default: gpu-results/); each part prints
#              its tables and its exit status
#   WHEELS     a folder of wheels (keras and what it needs, e.g. from the
#              README's `pip download` command) to install first under
#              /tmp/keras-mp-site, for a machine without Keras
#   JOBS       pytest workers for `tests` (default 6)
#   TESTS_PATHS  what `tests` runs (default "tests"; e.g. "tests/zoo" for a part)
#   TESTS_LIMIT, RERUN_LIMIT
#              seconds for each backend's suite in `tests` (default 900), and
#              for the deterministic rerun of its failures (default 300)
#   TF_MODELS, TF_XLA, TF_ROUNDS
#              tf_levels' models (default "transformer_large cnn_large", the
#              latter ResNet50), XLA settings (default "true false") and rounds (3)
set -u
cd "$(dirname "$0")/.."
# Several processes share the GPU (pytest workers): none may take all its memory.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_FORCE_GPU_ALLOW_GROWTH=true
export TF_CPP_MIN_LOG_LEVEL=2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu-results}
JOBS=${JOBS:-6}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/keras-mp-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="/tmp/keras-mp-site:$PYTHONPATH"
fi
if [ -z "${BACKENDS:-}" ]; then
    BACKENDS=""
    python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null && BACKENDS="jax"
    python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && BACKENDS="$BACKENDS torch"
    python3 -c "import tensorflow as tf; assert tf.config.list_physical_devices('GPU')" 2>/dev/null \
        && BACKENDS="$BACKENDS tensorflow"
fi
[ -n "$BACKENDS" ] || { echo "no backend sees a GPU (set BACKENDS to force some)"; exit 1; }
has() { [[ " $BACKENDS " == *" $1 "* ]]; }

# step SECONDS NAME COMMAND...: runs it under a time limit, logs it, prints its tables.
step() {
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date +%T))"
    (cd benchmarks && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "^\||^#|Error|error:" "$OUT/$name.log" | grep -v -i warn | tail -40
    echo "=== $name rc=$rc"
}

LEVELS=(O0 "O2 float16" "O1 bfloat16" "O2 bfloat16" "O3 bfloat16" "keras mixed_float16" "keras mixed_bfloat16")

sanity() {
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    for b in $BACKENDS; do
        KERAS_BACKEND=$b python3 - <<'EOF' 2>&1 | grep -v -E "^(W|I)[0-9]{4}" | tail -3
import keras
import numpy as np

import keras_mp

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
model.compile(optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse", amp_level="O2")
history = model.fit(np.ones((64, 8), "float32"), np.ones((64, 4), "float32"), epochs=2, verbose=0)
kernel = model.layers[0].kernel.value
print(keras.backend.backend(), keras.__version__, "on", getattr(kernel, "device", "?"),
      {k: [float(x) for x in v] for k, v in history.history.items()})
EOF
    done
}

tests() {
    local workers=(-n "$JOBS")
    python3 -c "import xdist" 2>/dev/null || workers=()  # no pytest-xdist: one process
    for b in $BACKENDS; do
        echo "=== tests on $b ($(date +%T))"
        # -v: a run cut short by its time limit still names its failures.
        # _report_failures: each failure's traceback as it happens.
        KERAS_BACKEND=$b FAILURES_LOG="$OUT/failures_$b.log" PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" \
            timeout "${TESTS_LIMIT:-900}" python3 -m pytest "${workers[@]}" -v --tb=short -rfE \
            -p no:cacheprovider -p no:benchmark -p _report_failures ${TESTS_PATHS:-tests} \
            > "$OUT/tests_$b.log" 2>&1
        echo "rc=$?" >> "$OUT/tests_$b.log"
        grep -E "FAILED|ERROR|^rc=| passed| failed" "$OUT/tests_$b.log" | tail -60
        # The failures again, with the GPU's sources of run-to-run differences
        # off (XLA's autotuning and atomic reductions, TF's own kernels): a test
        # that passes then compares two compilations more tightly than a GPU keeps.
        local failed
        mapfile -t failed < <(grep -oE "FAILED tests/[^ ]+" "$OUT/tests_$b.log" | cut -c8- | sort -u)
        [ ${#failed[@]} -gt 0 ] || continue
        echo "=== the ${#failed[@]} failures on $b, deterministic ($(date +%T))"
        KERAS_BACKEND=$b TF_DETERMINISTIC_OPS=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true" \
            timeout "${RERUN_LIMIT:-300}" python3 -m pytest "${workers[@]}" -v --tb=short -rfE \
            -p no:cacheprovider -p no:benchmark "${failed[@]}" > "$OUT/tests_${b}_deterministic.log" 2>&1
        echo "rc=$?" >> "$OUT/tests_${b}_deterministic.log"
        grep -E "PASSED|FAILED|ERROR|^rc=| passed| failed" "$OUT/tests_${b}_deterministic.log" | tail -40
    done
}

overhead() {
    for b in $BACKENDS; do
        step 300 "lso_$b" env KERAS_BACKEND=$b python3 lso_overhead.py --rounds 21 --steps 50
    done
}

forms() {
    has jax || return 0
    step 120 forms_b64 python3 jax_skip_forms.py --samples 201
    step 120 forms_b512 python3 jax_skip_forms.py --samples 201 --batch 512
}

levels() {
    for b in $BACKENDS; do
        step 200 "levels_${b}_mlp_large" env KERAS_BACKEND=$b python3 amp_levels.py \
            --models mlp_large --batch 2048 --rounds 5 --configs "${LEVELS[@]}"
        step 200 "levels_${b}_transformer_large" env KERAS_BACKEND=$b python3 amp_levels.py \
            --models transformer_large --batch 64 --rounds 5 --configs "${LEVELS[@]}"
    done
}

census() {
    has jax || return 0
    for m in mlp_large transformer_large; do
        step 300 "census_$m" env KERAS_BACKEND=jax python3 hlo_census.py --models $m \
            --batch 64 --configs O0 "O2 float16" "O3 float16" "keras mixed_float16" \
            "O2 bfloat16" "keras mixed_bfloat16"
    done
}

masters() {
    for b in $BACKENDS; do
        step 200 "masters_$b" env KERAS_BACKEND=$b python3 master_weights.py \
            --width 2048 --batch 1024 --rounds 7
    done
}

profile() {
    for m in transformer_large mlp_large; do
        local batch=64
        [ $m = mlp_large ] && batch=2048
        has jax && step 300 "profile_jax_$m" env KERAS_BACKEND=jax python3 step_profile.py \
            --models $m --batch $batch
        has tensorflow && step 300 "profile_tf_$m" env KERAS_BACKEND=tensorflow python3 \
            step_profile.py --models $m --batch $batch --jit-compile true
    done
}

# TensorFlow on the GPU (issue 27): every level in float16 and bfloat16 against
# Keras's policies, with XLA and without, on ResNet50 and the transformer.
TF_LEVELS=(O0 "O1 float16" "O2 float16" "O3 float16" "O1 bfloat16" "O2 bfloat16" "O3 bfloat16"
    "keras mixed_float16" "keras mixed_bfloat16")
tf_levels() {
    has tensorflow || { echo "tf_levels: TensorFlow sees no GPU"; return 0; }
    local jit m
    for jit in ${TF_XLA:-true false}; do
        for m in ${TF_MODELS:-transformer_large cnn_large}; do
            step 300 "tf_levels_${m}_xla_$jit" env KERAS_BACKEND=tensorflow python3 \
                amp_levels.py --models "$m" --batch 64 --rounds "${TF_ROUNDS:-3}" \
                --jit-compile $jit --configs "${TF_LEVELS[@]}"
        done
    done
}

# Issue 50: ResNet50 and a ~100M KerasHub Gemma at their real sizes, each level
# against O0 with TF32 and strict float32, the speed report's bound beside each
# ratio; then peak memory per configuration and the largest batch per level.
real() {
    local b
    for b in $BACKENDS; do
        step 480 "real_$b" env KERAS_BACKEND=$b python3 real_models.py --rounds "${REAL_ROUNDS:-3}" \
            --configs O0 "O0 float32" "O2 float16" "O2 bfloat16" "O3 bfloat16" "O2 float8" \
            "O2 float8 +moments"
    done
}

real_memory() {
    step 480 real_memory python3 real_models.py --all --backends $BACKENDS --memory \
        --configs O0 "O2 float16" "O2 bfloat16" "O3 bfloat16" "O2 float8" "O2 float8 +moments"
    step 480 real_max_batch python3 real_models.py --all --backends $BACKENDS --max-batch \
        --models gemma --start-batch 16
}

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(sanity tests overhead forms census levels profile masters tf_levels real real_memory)
for part in "${PARTS[@]}"; do
    case $part in
        sanity|tests|overhead|forms|census|levels|profile|masters|tf_levels|real|real_memory) $part ;;
        *) echo "unknown part: $part (sanity, tests, overhead, forms, census, levels, profile," \
            "masters, tf_levels, real, real_memory)"
            exit 2 ;;
    esac
done
