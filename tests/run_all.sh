#!/usr/bin/env bash
# Runs each backend's tests in its own pytest process: Keras reads
# KERAS_BACKEND once, at import.
set -u
cd "$(dirname "$0")/.."
status=0
run() {
  local backend=$1
  shift
  [ "$#" -gt 0 ] || return 0
  echo "=== KERAS_BACKEND=$backend: $*"
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider "$@" || status=1
}
run jax $(ls tests/test_jax*.py tests/test_common*.py 2>/dev/null)
run torch $(ls tests/test_torch*.py 2>/dev/null)
run tensorflow $(ls tests/test_tensorflow*.py 2>/dev/null)
exit $status
