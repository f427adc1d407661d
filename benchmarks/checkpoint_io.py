"""Time and host memory of sharded checkpoints, and of direct calls on JAX.

Usage: `KERAS_BACKEND=jax python benchmarks/checkpoint_io.py [--model
resnet50] [--devices 2]`. Builds a model of the test zoo, splits it over
`--devices` virtual CPU devices with Adam's state built, and prints:

- the checkpoint's size and files, and the seconds and the host memory
  peak (tracemalloc, which counts NumPy buffers; on CPU, JAX adopts a
  loaded buffer as the device array, so the load peak includes the new
  parameters) of `save_checkpoint` and of `load_checkpoint`;
- the seconds of three direct calls `tp(x)` in a row (the first one
  compiles).
"""

import argparse
import os
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras_tp  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    keras_tp.configure_virtual_devices(args.devices)
    import numpy as np

    from tests import zoo

    model, x, _ = zoo.ZOO[args.model]()
    tp = keras_tp.TensorParallelKeras(model, world_size=args.devices)
    tp.compile(optimizer="adam", loss=zoo.loss_for(args.model))
    tp.optimizer.build(tp.trainable_variables)
    calls = []
    for _ in range(3):
        start = time.perf_counter()
        np.asarray(first_output(tp(x)))
        calls.append(time.perf_counter() - start)
    parameters = sum(int(np.prod(v.shape)) for v in tp.model.variables)
    directory = tempfile.mkdtemp()
    tracemalloc.start()
    start = time.perf_counter()
    manifest = tp.save_checkpoint(directory)
    save_seconds = time.perf_counter() - start
    save_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    start = time.perf_counter()
    tp.load_checkpoint(directory)
    load_seconds = time.perf_counter() - start
    load_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    sizes = [entry["bytes"] for entry in manifest["files"].values()]
    print(
        f"{args.model} at TP={args.devices}: {parameters:,} parameters; "
        f"checkpoint {sum(sizes) / 1e6:.1f} MB in {len(sizes)} files "
        f"(largest {max(sizes) / 1e6:.1f} MB)"
    )
    print(
        f"save {save_seconds:.2f} s, host peak {save_peak / 1e6:.1f} MB; "
        f"load {load_seconds:.2f} s, host peak {load_peak / 1e6:.1f} MB"
    )
    print("direct calls: " + ", ".join(f"{s:.3f} s" for s in calls))


def first_output(outputs):
    """The first output array (zoo models return one, keras-hub dicts)."""
    if isinstance(outputs, dict):
        return next(iter(outputs.values()))
    return outputs


if __name__ == "__main__":
    main()
