"""Item 4: keras_tp on TensorFlow replicas, TP=2 and DDP=2.

One TensorFlow process with two virtual CPU devices trains the same LM
four ways, round by round:

- one device: the plain Keras model;
- keras_tp TP=2: `TensorParallelKeras(model, world_size=2)`;
- keras_tp DDP=2: `TensorParallelKeras(model, world_size=2,
  data_parallel=2)`, whose `CoordinatedOptimizer` all-reduces gradient
  buckets;
- `tf.distribute.MirroredStrategy` over the same two devices with the
  plain Keras model: what a TensorFlow user picks for data parallelism.

Data parallelism splits each global batch over the two replicas; tensor
parallelism gives both ranks the whole batch.
"""

import time

import tensorflow as tf

import keras_tp
from benchmarks import models
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio


def run(progress, dim, blocks, heads, seq_len, vocab, batch, steps, repeats):
    """Times the four ways to train on two TensorFlow replicas.

    Args:
        progress: callable taking the fraction of the work done.
        dim, blocks, heads, seq_len, vocab: the LM's shape.
        batch: global batch size.
        steps: training steps per timed `fit()` epoch.
        repeats: timed rounds.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    shape = dict(
        dim=dim, blocks=blocks, heads=heads, seq_len=seq_len, vocab=vocab
    )
    x, y = models.language_data(batch * steps, seq_len, vocab)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        mirrored = models.compile_for_training(models.language_model(**shape))
    trained = {
        "one device": models.compile_for_training(
            models.language_model(**shape)
        ),
        "keras_tp TP=2": models.compile_for_training(
            keras_tp.TensorParallelKeras(
                models.language_model(**shape), world_size=2
            )
        ),
        "keras_tp DDP=2": models.compile_for_training(
            keras_tp.TensorParallelKeras(
                models.language_model(**shape), world_size=2, data_parallel=2
            )
        ),
        "MirroredStrategy": mirrored,
    }

    def one_epoch(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    first_fit = {name: one_epoch(model) for name, model in trained.items()}
    times = interleaved(
        {name: (lambda m=m: one_epoch(m)) for name, m in trained.items()},
        repeats,
        progress=progress,
    )
    return {
        "rows": [
            comparison(
                "tensorflow keras_tp DDP=2: training step",
                "MirroredStrategy, 2 replicas, plain Keras",
                ratio(times, "keras_tp DDP=2", "MirroredStrategy"),
                goal=("<=", 1.05),
            ),
            comparison(
                "tensorflow keras_tp DDP=2: training step",
                "one device",
                ratio(times, "keras_tp DDP=2", "one device"),
                note="2 virtual devices share 2 cores: overhead, not speed-up",
            ),
            comparison(
                "tensorflow keras_tp TP=2: training step",
                "one device",
                ratio(times, "keras_tp TP=2", "one device"),
            ),
            comparison(
                "tensorflow MirroredStrategy, 2 replicas: training step "
                "(context)",
                "one device",
                ratio(times, "MirroredStrategy", "one device"),
            ),
        ],
        "data": {
            "model": dict(shape, batch=batch),
            "devices": devices,
            "step_seconds": times,
            "first_fit_seconds_per_step": first_fit,
        },
    }
