#!/usr/bin/env bash
# The smoke tests (`-m floor`: the README quickstart, the custom loop of each
# backend, a .keras round trip) on the oldest Keras keras_mp supports, once
# per backend. CI runs it after the whole suite, in its own throwaway
# environment: it replaces the installed Keras with that release.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
FLOOR="$("$PYTHON" -c 'import re; t = open("pyproject.toml").read(); print(re.search(r"\"keras>=([0-9.]+)", t).group(1))')"
"$PYTHON" -m pip install -q --no-deps "keras==${FLOOR}.*" || exit 1
failed=()
for backend in tensorflow jax torch; do
    echo "=== Keras $("$PYTHON" -c 'import keras; print(keras.__version__)'), KERAS_BACKEND=$backend"
    # Only the files that hold them: collecting the zoo would import KerasHub,
    # whose release needs a newer Keras.
    if ! KERAS_BACKEND="$backend" "$PYTHON" -m pytest tests/test_readme.py tests/test_saving.py \
        -q -m floor -p no:cacheprovider "$@"; then
        failed+=("$backend")
    fi
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED on Keras ${FLOOR}: ${failed[*]}"
    exit 1
fi
echo "Keras ${FLOOR}: all backends passed"
