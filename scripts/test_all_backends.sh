#!/usr/bin/env bash
# Runs the whole test suite once per Keras backend, each in its own process
# (a Keras backend is fixed per process). Fails if any backend fails.
# Extra arguments go to pytest, e.g. `bash scripts/test_all_backends.sh -x`.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
failed=()
for backend in tensorflow jax torch; do
    echo "=== KERAS_BACKEND=$backend"
    if ! KERAS_BACKEND="$backend" "$PYTHON" -m pytest tests -q "$@"; then
        failed+=("$backend")
    fi
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED backends: ${failed[*]}"
    exit 1
fi
echo "All backends passed: tensorflow jax torch"
