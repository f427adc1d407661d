"""Hierarchical gradient reduction, shared by the torch and JAX tests.

A data axis of 4 ranks on 2 hosts: 4 torch ranks launched as 2 nodes of 2
(`launch(nproc_per_node=2)`), or 2 JAX processes with 2 devices each
(`jax.distributed`). Each run trains the MLP with
`CoordinatedOptimizer(hierarchical=True)` next to the same model on one
device, and counts what each level sent.
"""

import math

from tests import dp_cases
from tests import models

HOSTS = 2
RANKS_PER_HOST = 2
# (zero_stage, optimizer, CoordinatedOptimizer options): DDP's all-reduce,
# and ZeRO-1's reduce-scatter and all-gather in several buckets.
CASES = [
    (0, "sgd", {}),
    (1, "adam", {"bucket_cap_mb": 0.002}),
]


def runs():
    """Trains every case; returns what `check_runs` asserts, per case."""
    results = []
    for stage, kind, options in CASES:
        reference, tp, reference_history, tp_history = dp_cases.train_pair(
            "mlp", 4, 4, stage, kind, hierarchical=True, **options
        )
        dp_cases.check_matches_one_device(
            reference, tp, reference_history, tp_history
        )
        results.append(
            {
                "case": [stage, kind, options],
                "hosts": tp.get_gradient_sharding_info()["hosts"],
                "levels": {
                    level: _optimizer_bytes(tp, f"data/{level}")
                    for level in ("within_host", "across_hosts")
                },
                "data": _optimizer_bytes(tp, "data"),
            }
        )
    return results


def _optimizer_bytes(tp, axis):
    return {
        kind: entry["optimizer_bytes"]
        for kind, entry in tp.communication_stats(axis=axis).items()
        if entry["optimizer_bytes"]
    }


def check_runs(results):
    """Asserts each level sent what the hierarchy's math says.

    With `psi` bytes of gradient, a rank reduce-scatters `psi` within its
    host, then `psi / RANKS_PER_HOST` across hosts, and all-gathers the
    result back the same way: across hosts for DDP's all-reduce, the
    updated parameter partitions for ZeRO-1 and 2. A flat reduction would
    all-reduce all of `psi` over the axis, whose ring crosses hosts.
    """
    psi = sum(v.numpy().nbytes for v in models.mlp().trainable_variables)
    for result in results:
        _, _, options = result["case"]
        assert result["hosts"] == HOSTS, result
        within = result["levels"]["within_host"]
        across = result["levels"]["across_hosts"]
        assert set(within) == set(across) == {"reduce_scatter", "all_gather"}
        cap = options.get("bucket_cap_mb", 25) * 2**20
        # DDP pads each piece to whole floats for the 4 ranks.
        padding = math.ceil(psi / cap) * 3 * 4
        for kind in within:
            assert across[kind] * RANKS_PER_HOST == within[kind], result
            assert psi <= within[kind] <= psi + padding, result
        # Nothing goes over the data axis but through the two levels.
        assert result["data"] == {
            kind: within[kind] + across[kind] for kind in within
        }
