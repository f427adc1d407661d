#!/usr/bin/env bash
# Runs each backend's tests in its own pytest process: Keras reads
# KERAS_BACKEND once, at import.
set -u
cd "$(dirname "$0")/.."
status=0
run() {
  local backend=$1 options=$2
  shift 2
  [ "$#" -gt 0 ] || return 0
  echo "=== KERAS_BACKEND=$backend: $*"
  # shellcheck disable=SC2086  # options are several words
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider $options "$@" \
    || status=1
}
# JAX and the backend-free tests spend most of their time in XLA's compiler,
# one core at a time: two worker processes (pytest-xdist) take a test file
# each. torch and TensorFlow tests start rank processes and replica threads
# of their own and check timeouts and heartbeats, so they run alone.
run jax "-n 2 --dist loadfile" $(ls tests/test_jax*.py tests/test_common*.py 2>/dev/null)
run torch "" $(ls tests/test_torch*.py 2>/dev/null)
run tensorflow "" $(ls tests/test_tensorflow*.py 2>/dev/null)
exit $status
