#!/usr/bin/env bash
# Runs each backend's tests in its own pytest process: Keras reads
# KERAS_BACKEND once, at import.
set -u
cd "$(dirname "$0")/.."
status=0
run() {
  local backend=$1 options=$2 start=$SECONDS
  shift 2
  [ "$#" -gt 0 ] || return 0
  echo "=== KERAS_BACKEND=$backend: $*"
  # The slowest tests are listed: the suite must stay under CI's limit
  # (`tests/cpu_times.py` records every test's CPU time).
  # shellcheck disable=SC2086  # options are several words
  KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider \
    --durations=15 $options "$@"
  local code=$?
  echo "=== KERAS_BACKEND=$backend: $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
  return $code
}
# Most tests spend their time in compilers and in waiting for replicas, one
# core at a time: two worker processes (pytest-xdist) take a test file each.
# torch's tests run in one process: each starts rank processes of its own,
# which keep 1.5 of the 2 cores busy.
# pytest-xdist sorts files by their number of tests unless told not to;
# the order given here is by their time instead (below).
parallel="-n 2 --dist loadfile --no-loadscope-reorder"
# Tests build the same models again and again, and JAX compiles each one's
# programs anew; its persistent compilation cache, fresh for this run,
# compiles each program once. A size limit turns on its file lock, which
# the two workers share.
JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
export JAX_COMPILATION_CACHE_DIR
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
export JAX_COMPILATION_CACHE_MAX_SIZE=$((2 * 1024 * 1024 * 1024))
# The tests' programs are tiny: compiling them costs more than running
# them. XLA's lowest optimization level compiles about 30% faster, and
# its older CPU emitters (no fusion emitters) another 30%; the parity
# checks compare programs compiled alike. Two test processes share the two
# cores: one thread per op's own work (no Eigen thread pool) saves 5% of
# the CPU time. XLA's CPU collectives end the process when a device's
# thread has not joined a collective within 40 s: on 2 busy cores one can
# be starved that long (a notebook's kernel died so), so the suite waits
# 5 minutes.
export XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false --xla_cpu_multi_thread_eigen=false --xla_cpu_collective_call_terminate_timeout_seconds=300"
# JAX's CPU client runs each device's programs on a pool of max(cores,
# devices) threads: 4 virtual devices on 2 cores get exactly 4, and a
# collective of all 4 then waits forever when one of the threads is busy
# with other work (the compression notebook's kernel died so, with 3 of
# 4 devices in an all-reduce after 300 s). XLA reads the pool's size
# from PJRT_NPROC; the threads wait without computing (no Eigen pool).
export PJRT_NPROC=16
# Two test processes share the two cores: TensorFlow's default of a thread
# per core for each op's own work oversubscribes them (20% slower).
export TF_NUM_INTRAOP_THREADS=1
# Files go to the two workers one at a time, in the order given: the
# longest go first (by their time in the last CI, `tests/cpu_times.py`),
# so that no worker is left with one long file at the end.
ordered() {
  local first=$1 pattern=$2 seen=""
  shift 2
  for file in $first $(ls $pattern 2>/dev/null); do
    [ -e "$file" ] || continue
    case " $* $seen " in *" $file "*) continue ;; esac
    seen="$seen $file"
    echo "$file"
  done
}
# A worker process keeps the virtual devices its first file configured;
# the 3-D pipeline tests need 8 (data x pipe x model), the others 4.
jax_eight=tests/test_jax_pipeline.py
tensorflow_eight=tests/test_tensorflow_pipeline_3d.py
# These time a hung, stuck or slow rank against a clock: they run last,
# with nothing else on the cores.
torch_timed="tests/test_torch_elastic.py tests/test_torch_straggler.py"
tensorflow_timed=tests/test_tensorflow_multiworker_timeout.py
# Ray Train's runs mostly wait (for their cluster, their workers, a
# restart), but Ray's own processes take a core for a minute or two
# each: they run one after the other, beside torch's other tests, which
# leave a quarter of the cores idle while their ranks wait for one
# another (among JAX's files, JAX's made that phase 4 minutes longer).
torch_ray=tests/test_torch_ray.py
tensorflow_ray=tests/test_tensorflow_ray.py
jax_ray=tests/test_jax_ray.py
logs=$(mktemp -d)
trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR" "$logs"' EXIT
# Starts a command (`run ...`) in the background, its output kept for
# `shown`.
started() {
  local name=$1
  shift
  "$@" > "$logs/$name" 2>&1 &
  echo $! > "$logs/$name.pid"
}
# torch's and TensorFlow's Ray Train tests, one after the other: each
# starts a local Ray cluster of its own. Together they outlast torch's
# other tests (6:30 against 5:16), so JAX's, the shortest (a minute,
# mostly waiting), runs beside TensorFlow's tests instead.
ray_runs() {
  local code=0
  run torch "" $(ls $torch_ray 2>/dev/null) || code=1
  run tensorflow "" $(ls $tensorflow_ray 2>/dev/null) || code=1
  return $code
}
# Waits for a background run, then shows its output.
shown() {
  wait "$(cat "$logs/$1.pid")" || status=1
  cat "$logs/$1"
}
# The phases run one after another. Beside another phase, torch's rank
# processes wait for their turn on the cores, and each step waits for its
# slowest rank: with torch beside JAX and TensorFlow the suite took 41
# minutes, one after another 24 (JAX 7:09, 8 devices 1:41, TensorFlow
# 8:21, torch 5:05, timed 1:41).
# The two 8-device files run beside JAX's other files, in processes of
# their own: on their own, the two of them left a core idle for the last
# fifth of their phase, and each phase's start (imports, collection)
# keeps one core busy at a time.
started jax_eight run jax "" $(ls $jax_eight 2>/dev/null)
started tensorflow_eight run tensorflow "" $(ls $tensorflow_eight 2>/dev/null)
run jax "$parallel" $(ordered "tests/test_jax.py tests/test_jax_zoo.py \
  tests/test_common_notebooks.py tests/test_jax_dp.py \
  tests/test_common_examples.py tests/test_jax_checkpoint.py \
  tests/test_common_benchmarks.py tests/test_jax_sequence_parallel.py \
  tests/test_jax_mpi.py tests/test_common_pipeline_stages.py \
  tests/test_jax_compression.py tests/test_common_cli.py" \
  "tests/test_jax*.py tests/test_common*.py" $jax_eight $jax_ray) \
  || status=1
shown jax_eight
shown tensorflow_eight
started jax_ray run jax "" $(ls $jax_ray 2>/dev/null)
run tensorflow "$parallel" $(ordered "tests/test_tensorflow_zoo.py \
  tests/test_tensorflow.py tests/test_tensorflow_sequence_parallel.py \
  tests/test_tensorflow_dp.py tests/test_tensorflow_checkpoint.py \
  tests/test_tensorflow_pipeline.py tests/test_tensorflow_soak.py \
  tests/test_tensorflow_compression.py" \
  "tests/test_tensorflow*.py" $tensorflow_eight $tensorflow_timed \
  $tensorflow_ray) || status=1
shown jax_ray
started ray ray_runs
run torch "" $(ordered "" "tests/test_torch*.py" $torch_timed $torch_ray) \
  || status=1
shown ray
started tensorflow_timed run tensorflow "" $(ls $tensorflow_timed 2>/dev/null)
run torch "" $(ls $torch_timed 2>/dev/null) || status=1
shown tensorflow_timed
exit $status
