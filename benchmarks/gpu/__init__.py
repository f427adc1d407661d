"""The GPU run: everything worth measuring when a GPU is lent, ready.

    python -m benchmarks.gpu [--out benchmarks/results]
    python -m benchmarks.gpu --cpu-smoke --out /tmp/smoke

On one GPU (3.3 minutes for JAX and torch on an H100, 2026-11-27), every
backend that sees the GPU measures (each backend in processes
of its own, since Keras reads `KERAS_BACKEND` at import):

- `TensorParallelKeras(world_size=1)` against plain `fit()`: overhead;
- `mixed_bfloat16` and `mixed_float16` (its loss scaled) training
  against float32: step time and loss parity;
- the model FLOPs utilisation of a GPT2-medium-sized step (keras-hub's
  GPT2 built from its config, random weights, no download);

and, once each:

- TensorFlow: tensor parallelism over two logical GPUs carved from the
  one card, against one device;
- JAX: keras_tp against `keras.distribution.ModelParallel` with the same
  plan at TP=1.

It writes `<date>-<device>.json` and `.md` into `--out`, the device named
from the GPU. `--cpu-smoke` runs the same code on the CPU at tiny sizes in
seconds (`tests/test_common_benchmarks.py` runs it), so the script cannot
rot between GPU sessions.
"""
