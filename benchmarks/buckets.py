"""Item 8: DDP's gradient bucket size, swept on torch.

Two gloo processes train the MLP stack data-parallel (`data_parallel=2`)
with a `CoordinatedOptimizer` per bucket size. Each bucket is one
all-reduce, so small buckets mean many small calls (latency) and large
ones few large calls (no overlap is possible either way, since keras_tp
synchronises after the backward pass). The seed's advice is 1-50 MB per
network; torch DDP's default is 25 MB. Interleaved, per bucket size: the
all-reduce calls per step and the step time relative to 25 MB.
"""

import time

import keras

import keras_tp
from benchmarks import models
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio

REFERENCE_MB = 25


def run(progress, sizes, batch, steps, repeats, bucket_caps_mb, timeout=900):
    """Starts two torch ranks and sweeps `bucket_cap_mb`.

    Args:
        progress: callable taking the fraction of the work done.
        sizes: the MLP stack's shape.
        batch: global batch (each rank trains on half).
        steps: training steps per timed repetition.
        repeats: timed rounds.
        bucket_caps_mb: bucket sizes to compare; must include 25.
        timeout: seconds before `launch` stops the ranks.

    Returns:
        `{"rows": [...], "data": {...}}` from rank 0.
    """
    return keras_tp.launch(
        _rank,
        world_size=2,
        kwargs=dict(
            progress=progress,
            sizes=sizes,
            batch=batch,
            steps=steps,
            repeats=repeats,
            bucket_caps_mb=bucket_caps_mb,
        ),
        timeout=timeout,
    )


def _rank(progress, sizes, batch, steps, repeats, bucket_caps_mb):
    import torch.distributed as dist

    x, y = models.mlp_data(batch * steps, sizes["features"], sizes["classes"])
    trained = {}
    for cap in bucket_caps_mb:
        tp = keras_tp.TensorParallelKeras(
            models.mlp_stack(**sizes), world_size=2, data_parallel=2
        )
        tp.compile(
            optimizer=keras_tp.CoordinatedOptimizer(
                keras.optimizers.Adam(1e-3), bucket_cap_mb=cap
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        trained[cap] = tp
    rank = dist.get_rank()

    def one_epoch(model):
        dist.barrier()
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    times = interleaved(
        {cap: (lambda m=m: one_epoch(m)) for cap, m in trained.items()},
        repeats,
        warmup=1,
        progress=progress if rank == 0 else None,
    )
    calls = {
        cap: model.communication_stats(axis="data")
        .get("all_reduce", {})
        .get("optimizer_calls", 0)
        for cap, model in trained.items()
    }
    gradient_mb = (
        sum(
            int(keras.ops.size(v))
            for v in trained[REFERENCE_MB].model.trainable_variables
        )
        * 4
        / 2**20
    )
    if rank != 0:
        return None
    rows = []
    for cap in bucket_caps_mb:
        rows.append(
            comparison(
                f"torch DDP=2, bucket_cap_mb={cap:g}: training step "
                f"({calls[cap]} all-reduce calls)",
                f"bucket_cap_mb={REFERENCE_MB}",
                ratio(times, cap, REFERENCE_MB),
            )
        )
    return {
        "rows": rows,
        "data": {
            "model": dict(sizes, batch=batch),
            "gradient_mb": gradient_mb,
            "bucket_cap_mb": list(bucket_caps_mb),
            "all_reduce_calls": [calls[c] for c in bucket_caps_mb],
            "step_seconds": {str(c): times[c] for c in bucket_caps_mb},
        },
    }
