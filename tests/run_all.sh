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
  # The slowest tests are listed: the suite must stay under CI's limit.
  # shellcheck disable=SC2086  # options are several words
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider \
    --durations=15 $options "$@"
}
# Most tests spend their time in compilers and in waiting for replicas, one
# core at a time: two worker processes (pytest-xdist) take a test file each.
# Tests that time collectives run alone: torch's (rank processes of their
# own, heartbeats, timeouts) and TensorFlow's multi-worker timeouts.
parallel="-n 2 --dist loadfile"
# Tests build the same models again and again, and JAX compiles each one's
# programs anew; its persistent compilation cache, fresh for this run,
# compiles each program once. A size limit turns on its file lock, which
# the two workers share.
JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
export JAX_COMPILATION_CACHE_DIR
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
export JAX_COMPILATION_CACHE_MAX_SIZE=$((2 * 1024 * 1024 * 1024))
trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
# The tests' programs are tiny: compiling them costs more than running
# them. XLA's lowest optimization level compiles about 30% faster, and
# its older CPU emitters (no fusion emitters) another 30%; the parity
# checks compare programs compiled alike.
export XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
# Two test processes share the two cores: TensorFlow's default of a thread
# per core for each op's own work oversubscribes them (20% slower).
export TF_NUM_INTRAOP_THREADS=1
timed=tests/test_tensorflow_multiworker_timeout.py
# A worker process keeps the virtual devices its first file configured;
# the 3-D pipeline tests need 8 (data x pipe x model), the others 4.
eight_devices=tests/test_jax_pipeline.py
tensorflow_eight_devices=tests/test_tensorflow_pipeline_3d.py
run jax "$parallel" $(ls tests/test_jax*.py tests/test_common*.py 2>/dev/null \
  | grep -vx "$eight_devices") || status=1
# The two 8-device files run at the same time, one core each mostly; each
# one's output is shown once it is done.
logs=$(mktemp -d)
run jax "" $(ls "$eight_devices" 2>/dev/null) > "$logs/jax" 2>&1 &
jax_eight=$!
run tensorflow "" $(ls "$tensorflow_eight_devices" 2>/dev/null) \
  > "$logs/tensorflow" 2>&1 &
tensorflow_eight=$!
wait $jax_eight || status=1
wait $tensorflow_eight || status=1
cat "$logs/jax" "$logs/tensorflow"
rm -rf "$logs"
run torch "" $(ls tests/test_torch*.py 2>/dev/null) || status=1
run tensorflow "$parallel" $(ls tests/test_tensorflow*.py 2>/dev/null \
  | grep -vx -e "$timed" -e "$tensorflow_eight_devices") || status=1
run tensorflow "" $(ls "$timed" 2>/dev/null) || status=1
exit $status
