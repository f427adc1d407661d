"""Collectives over an axis whose ranks sit on several hosts.

Links between hosts are slower than links inside one, so a hierarchical
all-reduce sends as little as it can between hosts, as Horovod's and
NCCL's do:

1. reduce-scatter within each host: each of its `L` ranks holds the
   host's sum of `1/L` of the tensor;
2. all-reduce that `1/L` across hosts, among the ranks at the same place
   on every host;
3. all-gather within each host.

Step 2 is the only traffic between hosts: `1/L` of the tensor per rank,
where a flat ring all-reduce sends all of it over the host boundary.
"""

from keras import ops

from keras_tp.collectives.base import CollectiveAdapter


class HierarchicalAdapter(CollectiveAdapter):
    """An axis of `H` hosts with `L` ranks each, reduced within hosts first.

    Rank `r` of the axis is rank `r % L` of its host's group (`within`)
    and rank `r // L` of its group across hosts (`across`: the ranks at
    place `r % L` on every host). The raw collectives are built from the
    two levels' reduce-scatters and all-gathers, so the results equal a
    flat axis' and each level counts what it sends, under the axis
    `"<axis>/within_host"` or `"<axis>/across_hosts"`.

    The Megatron operators and ZeRO-3's parameter gathers are not
    hierarchical: the optimizer's gradient collectives are.

    Args:
        within: the adapter of this rank's host group.
        across: the adapter of this rank's group across hosts.
        axis_name: the axis the two levels split.
    """

    def __init__(self, within, across, axis_name="data"):
        self.within = within
        self.across = across
        # Gives both levels one new ledger (see the `stats` setter).
        super().__init__(axis_name)
        within.stats_axis = f"{axis_name}/within_host"
        across.stats_axis = f"{axis_name}/across_hosts"
        self.backend = within.backend

    @property
    def stats(self):
        return self.within.stats

    @stats.setter
    def stats(self, stats):
        # The levels count the calls; the two share one ledger.
        self.within.stats = stats
        self.across.stats = stats

    @property
    def communicate(self):
        return self.within.communicate

    @communicate.setter
    def communicate(self, communicate):
        self.within.communicate = communicate
        self.across.communicate = communicate

    @property
    def hosts(self):
        """Number of hosts (`H`)."""
        return self.across.size()

    @property
    def ranks_per_host(self):
        """Number of ranks on each host (`L`)."""
        return self.within.size()

    def rank(self):
        return self.across.rank() * self.ranks_per_host + self.within.rank()

    def size(self):
        return self.hosts * self.ranks_per_host

    def barrier(self):
        self.within.barrier()
        self.across.barrier()

    def _record(self, kind, x, direction=None, scale=1):
        """Counts nothing: each level counts the calls it makes."""

    def _all_reduce(self, x, op):
        if op in ("max", "min"):
            return self.across.all_reduce(self.within.all_reduce(x, op), op)
        shape = tuple(x.shape)
        flat = ops.reshape(x, (-1,))
        length = int(flat.shape[0])
        padding = -length % self.size()
        if padding:
            flat = ops.pad(flat, [(0, padding)])
        # Reduce-scatter then all-gather across hosts is the all-reduce of
        # step 2, in collectives every backend has on a part of its ranks.
        part = self.within.reduce_scatter(flat, 0, "sum")
        part = self.across.reduce_scatter(part, 0, "sum")
        part = self.across.all_gather(part, 0)
        flat = self.within.all_gather(part, 0)[:length]
        out = ops.reshape(flat, shape)
        return out / self.size() if op == "mean" else out

    def _reduce_scatter(self, x, axis, op):
        # Rank (h, l) must receive block h * L + l: order the blocks by
        # (l, h) first, so that the within-host reduce-scatter leaves
        # rank l the blocks (l, *), of which host h keeps (l, h).
        hosts, local = self.hosts, self.ranks_per_host
        blocks = _swap_levels(ops.moveaxis(x, axis, 0), hosts, local)
        part = self.within.reduce_scatter(blocks, 0, "sum")
        part = self.across.reduce_scatter(part, 0, "sum")
        part = part / self.size() if op == "mean" else part
        return ops.moveaxis(part, 0, axis)

    def _all_gather(self, x, axis):
        part = self.across.all_gather(ops.moveaxis(x, axis, 0), 0)
        gathered = self.within.all_gather(part, 0)
        # The blocks arrive ordered (l, h); the axis orders them (h, l).
        full = _swap_levels(gathered, self.ranks_per_host, self.hosts)
        return ops.moveaxis(full, 0, axis)

    def _broadcast(self, x, root):
        root_host, root_place = divmod(root, self.ranks_per_host)
        # Every host's rank at the root's place gets the root's value, then
        # hands it to its host.
        x = self.across.broadcast(x, root_host)
        return self.within.broadcast(x, root_place)


def _swap_levels(x, outer, inner):
    """Reorders the `outer * inner` blocks of axis 0 of `x`.

    The blocks are ordered by an outer then an inner index; the result
    orders them by the inner index first.
    """
    rest = tuple(x.shape[1:])
    block = int(x.shape[0]) // (outer * inner)
    x = ops.reshape(x, (outer, inner, block) + rest)
    x = ops.swapaxes(x, 0, 1)
    return ops.reshape(x, (outer * inner * block,) + rest)


def host_groups(hosts):
    """The within-host and across-host groups of an axis.

    Args:
        hosts: the host of each rank of the axis, in rank order.

    Returns:
        `(within, across)`: lists of rank lists. `within[h]` is host `h`'s
        ranks; `across[l]` is the `l`-th rank of every host.

    Raises:
        ValueError: if the hosts hold different numbers of ranks, or a
            host's ranks are not consecutive.
    """
    order = list(dict.fromkeys(hosts))
    within = [[r for r, h in enumerate(hosts) if h == host] for host in order]
    local = len(within[0])
    consecutive = [
        list(range(i * local, (i + 1) * local)) for i in range(len(order))
    ]
    if within != consecutive:
        raise ValueError(
            "hierarchical=True needs every host to hold the same number of "
            "consecutive data-parallel ranks (as torchrun and "
            f"jax.distributed number them), but the hosts of the data ranks "
            f"are {list(hosts)}. Start the same number of ranks on every "
            "host, or use hierarchical=False."
        )
    across = [[group[place] for group in within] for place in range(local)]
    return within, across
