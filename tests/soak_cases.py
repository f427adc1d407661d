"""Long training runs: host memory and live tensors stay flat.

One run trains a small MLP wrapped by `TensorParallelKeras` with Keras'
`fit()`, with the statistics and timelines a user would read after every
step (`communication_stats()`, a `CoordinatedOptimizer`'s
`bucket_timeline()`) and Keras callbacks on, and samples this process's
host memory (the resident set and `malloc`'s bytes in use) and its
counts of live tensors and Python objects every few steps. JAX and
TensorFlow run it in the test process; torch on every rank, which all
return their samples to rank 0.

`benchmarks/soak.py` runs it for 1,000 steps; each backend's test runs a
shorter one and asserts `check_flat`.
"""

import ctypes
import gc
import os

import keras
import numpy as np

import keras_tp
from tests import models
from tests.models import loss_fn

BATCH = 8
STEPS_PER_EPOCH = 25
# The test's run: steps before the first sample that counts (buffers,
# traces and caches fill), then steps measured.
TEST_WARM_UP = 100
TEST_STEPS = 200
TEST_SAMPLE_EVERY = 50
# Growth allowed from the first sample after warm-up to the last. A leak
# of one tensor per step adds `TEST_STEPS - TEST_WARM_UP` (100) tensors.
LIVE_TENSOR_SLACK = 8
# Python objects (gc-tracked) allowed to appear in that time: a leak of
# one object per step adds 100.
PYTHON_OBJECT_SLACK = 32
# Host memory allowed to grow per measured step: `malloc`'s bytes in use,
# which a leak raises. Not the resident set where the heap is known: it
# also moves with the allocator's arenas and the pages other threads
# touch, and a test process that ran other tests first measures theirs
# too (3.8 MB in 100 steps once, for 1.1 MB more heap). The bound is
# above what the backends keep on their own (`benchmarks/soak.py`, 1,000
# steps): torch's heap grows 1 to 4 KiB a step in its first 500 to 1,000
# steps, then stays flat (3,000 steps). A leak of 16 KiB a step (this
# MLP's batch of activations 16 times over, a traced graph) fails.
HOST_BYTES_PER_STEP = 16 * 1024


def resident_bytes():
    """This process's resident set size, from `/proc/self/statm`."""
    with open("/proc/self/statm") as file:
        pages = int(file.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class _MallocInfo(ctypes.Structure):
    # glibc's `struct mallinfo2`.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_bytes():
    """Bytes that `malloc` has handed out and not had back (glibc's
    `mallinfo2`, every arena), or `None` without it.

    Unlike the resident set, which freed heap pages stay in, it grows with
    a leak at once: the backends' host buffers come from `malloc`.
    """
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallocInfo
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def live_tensors(objects):
    """How many tensors this process holds (collect garbage first).

    JAX: its live arrays (device buffers). torch: the `torch.Tensor`
    objects the garbage collector tracks (parameters, gradients, optimizer
    slots, anything cached). TensorFlow: its eager tensors and variables.

    Args:
        objects: `gc.get_objects()`, read once for every count.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return len(jax.live_arrays())
    if backend == "torch":
        import torch

        kinds = (torch.Tensor,)
    else:
        import tensorflow as tf

        kinds = (type(tf.constant(0.0)), tf.Variable)
    # By type: `isinstance` would read `__class__` of every object, which
    # some deprecated module attributes warn about.
    return sum(issubclass(type(thing), kinds) for thing in objects)


class SoakProbe(keras.callbacks.Callback):
    """Reads the run's statistics every step; samples memory every
    `sample_every` steps.

    Args:
        trainer: the `TensorParallelKeras` model being fitted.
        sample_every: steps between two samples.
    """

    def __init__(self, trainer, sample_every):
        super().__init__()
        self.trainer = trainer
        self.sample_every = sample_every
        self.step = 0
        self.samples = []
        self.collectives = 0

    def on_train_begin(self, logs=None):
        self.samples.append(self._sample())

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        stats = self.trainer.communication_stats()
        self.collectives = sum(kind["calls"] for kind in stats.values())
        timeline = getattr(self.trainer.optimizer, "bucket_timeline", None)
        if timeline is not None:
            timeline()
        if self.step % self.sample_every == 0:
            self.samples.append(self._sample())

    def _sample(self):
        gc.collect()
        objects = gc.get_objects()
        sample = {
            "step": self.step,
            "live_tensors": live_tensors(objects),
            "python_objects": len(objects),
            "rss_bytes": resident_bytes(),
            "heap_bytes": heap_bytes(),
        }
        return sample


def soak(steps, sample_every, world_size=2, data_parallel=1):
    """Trains for `steps` steps; this process's samples.

    Args:
        steps: training steps, a multiple of `STEPS_PER_EPOCH` (the run
            crosses `steps / STEPS_PER_EPOCH` epoch boundaries).
        sample_every: steps between two samples.
        world_size: devices (ranks on torch).
        data_parallel: replicas of the data axis; the optimizer is a
            `CoordinatedOptimizer` (DDP buckets) when above 1.

    Returns:
        `{"samples": [{"step", "live_tensors", "python_objects",
        "rss_bytes", "heap_bytes"}, ...],
        "collectives": calls of the last step, "loss": [first, last]}`.
    """
    trainer = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=world_size,
        data_parallel=data_parallel,
    )
    optimizer = keras.optimizers.Adam(1e-3)
    if data_parallel > 1:
        optimizer = keras_tp.CoordinatedOptimizer(optimizer)
    trainer.compile(optimizer=optimizer, loss=loss_fn())
    x, y = models.data_for("mlp", batch=BATCH * STEPS_PER_EPOCH)
    probe = SoakProbe(trainer, sample_every)
    history = trainer.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=steps // STEPS_PER_EPOCH,
        shuffle=True,
        verbose=0,
        callbacks=[probe, keras.callbacks.TerminateOnNaN()],
    )
    losses = history.history["loss"]
    return {
        "samples": probe.samples,
        "collectives": probe.collectives,
        "loss": [losses[0], losses[-1]],
    }


def soak_on_every_rank(steps, sample_every, world_size=2, data_parallel=1):
    """`soak` on a torch rank; rank 0 returns every rank's result."""
    import torch.distributed as dist

    result = soak(steps, sample_every, world_size, data_parallel)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def growth(samples, warm_up):
    """First and last sample after `warm_up` steps and the slopes between.

    Returns:
        `{"first", "last", "live_tensors_per_step",
        "python_objects_per_step", "heap_bytes_per_step",
        "rss_bytes_per_step"}`: the slopes are least-squares fits over the
        samples after warm-up (no heap slope without `heap_bytes`).
    """
    after = [s for s in samples if s["step"] >= warm_up]
    steps = np.array([s["step"] for s in after], dtype="float64")
    slopes = {
        f"{key}_per_step": float(
            np.polyfit(steps, [s[key] for s in after], 1)[0]
        )
        for key in ("live_tensors", "python_objects", "heap_bytes", "rss_bytes")
        if after[0][key] is not None
    }
    return {"first": after[0], "last": after[-1], **slopes}


def check_flat(
    samples, warm_up=TEST_WARM_UP, host_bytes_per_step=HOST_BYTES_PER_STEP
):
    """Asserts that live tensors, Python objects and host memory stay flat
    after `warm_up` steps (see `LIVE_TENSOR_SLACK`, `PYTHON_OBJECT_SLACK`;
    host memory may grow `host_bytes_per_step` a step).

    Returns:
        `growth(samples, warm_up)`.
    """
    measured = growth(samples, warm_up)
    first, last = measured["first"], measured["last"]
    steps = last["step"] - first["step"]
    assert steps > 0, samples
    added = last["live_tensors"] - first["live_tensors"]
    assert added <= LIVE_TENSOR_SLACK, (
        f"{added} more live tensors after {steps} steps: {samples}"
    )
    added = last["python_objects"] - first["python_objects"]
    assert added <= PYTHON_OBJECT_SLACK, (
        f"{added} more Python objects after {steps} steps: {samples}"
    )
    # Without mallinfo2 (not glibc), the resident set stands in.
    key = "rss_bytes" if first["heap_bytes"] is None else "heap_bytes"
    grown = last[key] - first[key]
    assert grown <= host_bytes_per_step * steps, (
        f"{key} grew {grown} bytes in {steps} steps: {samples}"
    )
    return measured
