#!/usr/bin/env bash
# Runs the whole test suite once per Keras backend, each in its own process
# (a Keras backend is fixed per process). Fails if any backend fails.
# Each backend's tests run in two worker processes (pytest-xdist, one per core
# of the CI machine); a worker that runs out of tests takes the other's
# (`--dist worksteal`), and the tests marked slow start first (conftest.py).
# Extra arguments go to pytest, e.g. `bash scripts/test_all_backends.sh -x`,
# or `-m "not heavy"` to leave out the model zoo's slowest families locally.
# `--durations=15` lists each backend's slowest tests (where CI's time goes).
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
failed=()
for backend in tensorflow jax torch; do
    echo "=== KERAS_BACKEND=$backend"
    start=$SECONDS
    if ! KERAS_BACKEND="$backend" "$PYTHON" -m pytest tests -q -n 2 --dist worksteal \
        --durations=15 "$@"; then
        failed+=("$backend")
    fi
    echo "=== KERAS_BACKEND=$backend took $((SECONDS - start)) s"
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED backends: ${failed[*]}"
    exit 1
fi
echo "All backends passed: tensorflow jax torch"
