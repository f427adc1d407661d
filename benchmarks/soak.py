"""A long training run: host memory and live tensors over 1,000 steps.

Trains the test suite's MLP (`tests.models.mlp`) wrapped by
`TensorParallelKeras` with Keras' `fit()` for `--steps` steps (25 steps an
epoch, so the run crosses 40 epoch boundaries), with the statistics and
timelines a user would read after every step on (`communication_stats()`
and, with data parallelism, the `CoordinatedOptimizer`'s
`bucket_timeline()`) and two Keras callbacks (the probe and
`TerminateOnNaN`). Every `--sample-every` steps, after a garbage
collection, it samples on every process (every torch rank):

- the live tensors: JAX's `jax.live_arrays()`; the `torch.Tensor` objects
  the garbage collector tracks; TensorFlow's eager tensors and variables;
- the Python objects the garbage collector tracks;
- the bytes `malloc` has handed out and not had back (glibc's
  `mallinfo2`), where a leak of host buffers shows at once;
- the resident set size, from `/proc/self/statm`.

It prints the samples at step 0, at the end of the warm-up and at the
end, and the least-squares slope per step after the warm-up, for two
meshes: tensor parallelism alone (TP=2) and data x tensor parallelism
(DP=2 x TP=2, four devices or ranks). JAX and TensorFlow run on virtual
CPU devices, torch on processes over gloo (`keras_tp.launch`).

    python benchmarks/soak.py --backend jax --json /tmp/soak-jax.json

The samples are what `tests/soak_cases.py` measures; each backend's
`tests/test_*_soak.py` asserts a bound on a shorter run.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, world size, data parallel)
MESHES = (("TP=2", 2, 1), ("DP=2 x TP=2", 4, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="jax", choices=("jax", "torch", "tensorflow")
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--warm-up", type=int, default=200)
    parser.add_argument("--json", help="file to write every sample to")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    sys.path.insert(0, ROOT)
    import keras_tp

    if args.backend != "torch":
        keras_tp.configure_virtual_devices(max(n for _, n, _ in MESHES))
    runs = []
    for name, world_size, data_parallel in MESHES:
        start = time.perf_counter()
        ranks = _measure(args, world_size, data_parallel)
        runs.append(
            {
                "mesh": name,
                "seconds": time.perf_counter() - start,
                "ranks": ranks,
            }
        )
    print(markdown(args, runs))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"backend": args.backend, "runs": runs}, file, indent=1)


def _measure(args, world_size, data_parallel):
    """Every process's result of `tests.soak_cases.soak`."""
    import keras_tp
    from tests import soak_cases

    soak_args = (args.steps, args.sample_every, world_size, data_parallel)
    if args.backend == "torch":
        return keras_tp.launch(
            soak_cases.soak_on_every_rank,
            world_size=world_size,
            args=soak_args,
            timeout=3600,
        )
    return [soak_cases.soak(*soak_args)]


def markdown(args, runs):
    """The table of the first, warmed-up and last samples and the slopes."""
    from tests.soak_cases import growth

    lines = [
        f"{args.backend}, {args.steps} steps, a sample every "
        f"{args.sample_every} steps, slopes after step {args.warm_up}",
        "",
        "| mesh | rank | live tensors: step 0 / warm / last | per step "
        "| Python objects: warm / last | heap MiB: warm / last "
        "| heap KiB per step | RSS MiB: step 0 / warm / last "
        "| RSS KiB per step | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for rank, result in enumerate(run["ranks"]):
            samples = result["samples"]
            measured = growth(samples, args.warm_up)
            start, warm, last = samples[0], measured["first"], measured["last"]
            mib = [s["rss_bytes"] / 2**20 for s in (start, warm, last)]
            heap = [s["heap_bytes"] / 2**20 for s in (warm, last)]
            lines.append(
                f"| {run['mesh']} | {rank} | {start['live_tensors']} / "
                f"{warm['live_tensors']} / {last['live_tensors']} | "
                f"{measured['live_tensors_per_step']:+.4f} | "
                f"{warm['python_objects']} / {last['python_objects']} | "
                f"{heap[0]:.1f} / {heap[1]:.1f} | "
                f"{measured['heap_bytes_per_step'] / 1024:+.2f} | "
                f"{mib[0]:.1f} / {mib[1]:.1f} / {mib[2]:.1f} | "
                f"{measured['rss_bytes_per_step'] / 1024:+.2f} | "
                f"{run['seconds']:.0f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
