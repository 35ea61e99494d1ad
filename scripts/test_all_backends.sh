#!/usr/bin/env bash
# Runs the whole test suite once per Keras backend, each in its own process
# (a Keras backend is fixed per process). Fails if any backend fails.
# Each backend's tests run in two worker processes (pytest-xdist, one per core
# of the CI machine). Extra arguments go to pytest, e.g.
# `bash scripts/test_all_backends.sh -x`, or `-m "not heavy"` to leave out the
# model zoo's slowest families locally.
# `--durations=15` lists each backend's slowest tests (where CI's time goes).
# TensorFlow's and PyTorch's kernels take the worker's share of the cores
# (one thread each on CI's two), not a pool as large as the machine per
# worker: on 2 cores their suites take 17% and 25% less time so. JAX's XLA
# client was slower with one thread: it keeps its own pool.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
WORKERS=2
cores=$(nproc 2>/dev/null || echo "$WORKERS")
share=$((cores / WORKERS > 0 ? cores / WORKERS : 1))
failed=()
for backend in tensorflow jax torch; do
    echo "=== KERAS_BACKEND=$backend"
    start=$SECONDS
    threads=()
    if [ "$backend" != jax ]; then
        threads=("OMP_NUM_THREADS=${OMP_NUM_THREADS:-$share}"
            "TF_NUM_INTRAOP_THREADS=${TF_NUM_INTRAOP_THREADS:-$share}")
    fi
    if ! env "${threads[@]}" KERAS_BACKEND="$backend" \
        "$PYTHON" -m pytest tests -q -n "$WORKERS" --durations=15 "$@"; then
        failed+=("$backend")
    fi
    echo "=== KERAS_BACKEND=$backend took $((SECONDS - start)) s"
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED backends: ${failed[*]}"
    exit 1
fi
echo "All backends passed: tensorflow jax torch"
