"""The levels of the data axis: its hosts, and its all-reduce's time.

What a `CoordinatedOptimizer` asks of the data axis beyond its adapter:
the two-level reduction of `hierarchical=True` (within each host, then
across hosts) and the all-reduce time that `bucket_cap_mb="auto"` sizes
its buckets from. The grouping is written here once; each backend's
runtime supplies the hosts of its ranks and the adapters of the groups.
"""

import functools
import logging

from keras_tp.collectives.hierarchy import HierarchicalAdapter
from keras_tp.collectives.hierarchy import host_groups

logger = logging.getLogger(__name__)


class DataAxisLevels:
    """Mixin of `MeshRuntime`: the data axis' hosts and timing.

    Needs `world_size`, `tensor_parallel`, `data_parallel`, `adapter` and
    `data_adapter` of the runtime it is mixed into.
    """

    @functools.cached_property
    def hierarchical_data_adapter(self):
        """The `data` axis' collectives, within each host first.

        For `CoordinatedOptimizer(hierarchical=True)`. Where every data
        rank is on one host, or each on its own, there is no hierarchy and
        this is `data_adapter`.

        Raises:
            ValueError: if the hosts hold different numbers of data ranks,
                not consecutive ones, or group them differently for
                different tensor-parallel shards.
        """
        hosts = self._rank_hosts()
        model = self.tensor_parallel
        groupings = {
            str(host_groups(hosts[column::model])) for column in range(model)
        }
        within, across = host_groups(hosts[::model])
        if len(groupings) > 1:
            raise ValueError(
                "hierarchical=True needs the data ranks of every "
                "tensor-parallel shard grouped alike into hosts, but the "
                f"hosts of the ranks are {hosts} (data x model mesh, "
                "row-major). Put whole tensor-parallel groups on each host."
            )
        if len(within) == 1 or len(across) == 1:
            logger.info(
                "hierarchical=True: the %d data ranks sit on %d host(s), so "
                "the data axis is reduced in one level.",
                self.data_parallel,
                len(within),
            )
            return self.data_adapter
        adapter = HierarchicalAdapter(*self._level_adapters(within, across))
        adapter.stats = self.adapter.stats
        return adapter

    def time_data_all_reduce(self, nbytes, repeats):
        """Median seconds of an all-reduce of `nbytes` over `data`.

        For `bucket_cap_mb="auto"` (`keras_tp.parallel.bucket_probe`).
        Every rank returns the same number, so all choose alike.

        Args:
            nbytes: the size of each rank's float32 buffer, in bytes.
            repeats: timed calls, after one untimed warm-up call.
        """
        raise NotImplementedError

    def _rank_hosts(self):
        """The host of every rank, in mesh order (data-major)."""
        return [0] * self.world_size

    def _level_adapters(self, within, across):
        """Adapters of the data axis' groups within and across hosts.

        Args:
            within: lists of data ranks, one per host.
            across: lists of data ranks, one per place on a host.

        Returns:
            `(within_adapter, across_adapter)` for this rank's groups.
        """
        raise NotImplementedError
