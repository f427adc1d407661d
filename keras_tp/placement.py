"""`Placement`: where each variable's pieces live on the `data x model` mesh.

Backend-free bookkeeping, read by the optimizer, the model's memory
reports and the checkpoint code: the axis a variable is split on over the
`model` axis, its full shape, and the axis its shard is partitioned on
over `data` (ZeRO). Storing the pieces is the backend's job: a `Placement`
hands that to its `storage` (the backend runtime).
"""

import dataclasses

from keras_tp import blocks as blocked


@dataclasses.dataclass(eq=False)
class Placement:
    """The split of every placed variable over a `data x model` mesh.

    Args:
        tensor_parallel: size of the `model` axis.
        data_parallel: size of the `data` axis.
        storage: the backend's variable storage, with `place_variable`,
            `place_variable_like`, `partition_variable`,
            `store_per_replica`, `full_value` and `assign_full_value`.

    By `id(variable)`, `axes` holds the `model`-axis split (`None`:
    replicated), `full_shapes` the full shape, and `data_axes` the ZeRO
    partition axis of the shard, and `blocks` the number of blocks of a
    variable split by blocks (`Column(blocks=b)`, stored permuted so that
    a contiguous split gives each rank its part of every block; see
    `keras_tp.blocks`). `per_replica` holds the ids of the
    variables whose copies on the data ranks may differ (local SGD), and
    `references` the variable each one placed like another (an optimizer
    slot) was placed like.
    """

    tensor_parallel: int
    data_parallel: int
    storage: object
    axes: dict = dataclasses.field(default_factory=dict, repr=False)
    full_shapes: dict = dataclasses.field(default_factory=dict, repr=False)
    data_axes: dict = dataclasses.field(default_factory=dict, repr=False)
    per_replica: set = dataclasses.field(default_factory=set, repr=False)
    references: dict = dataclasses.field(default_factory=dict, repr=False)
    blocks: dict = dataclasses.field(default_factory=dict, repr=False)

    def place(self, variable, axis, blocks=1):
        """Stores `variable` split on `axis` (`None`: replicated), each
        rank holding its part of each of `blocks` blocks on that axis."""
        self.axes[id(variable)] = axis
        self.full_shapes[id(variable)] = tuple(variable.shape)
        if axis is not None and blocks > 1:
            self.blocks[id(variable)] = blocks
            variable.assign(self.stored(variable, variable.value))
        self.storage.place_variable(variable, axis)

    def borrow(self, variable, axis):
        """Records the split of a variable that another `Placement` stores.

        For a weight that several pipeline stages use (a tied embedding):
        its owner's devices store it, and the other stages' programs read
        a copy, split as the owner's is.
        """
        self.axes[id(variable)] = axis
        self.full_shapes[id(variable)] = tuple(variable.shape)

    def place_like(self, variable, reference, data_axis=None):
        """Places a new variable shaped like a placed `reference`.

        For optimizer slots and gradient buffers: split like the reference
        over `model`, and partitioned over `data` on `data_axis` if given.
        """
        self.axes[id(variable)] = self.axes[id(reference)]
        self.full_shapes[id(variable)] = self.full_shapes[id(reference)]
        self.references[id(variable)] = reference
        if id(reference) in self.blocks:
            self.blocks[id(variable)] = self.blocks[id(reference)]
        self.storage.place_variable_like(variable, reference, data_axis)
        if data_axis is not None:
            self.data_axes[id(variable)] = data_axis

    def partition(self, variable, data_axis):
        """Keeps only this rank's ZeRO-3 partition of a placed variable."""
        self.storage.partition_variable(variable, data_axis)
        self.data_axes[id(variable)] = data_axis

    def keep_per_replica(self, variable):
        """Lets the data ranks' copies of a placed variable differ.

        For local SGD, whose replicas update their parameters and
        optimizer state alone between synchronisations. Full values read
        replica 0's copy; full values written go to every replica.
        """
        self.per_replica.add(id(variable))
        self.storage.store_per_replica(variable)

    def is_per_replica(self, variable):
        """Whether the data ranks' copies of `variable` may differ."""
        return id(variable) in self.per_replica

    def is_placed(self, variable):
        return id(variable) in self.axes

    def split_axis(self, variable):
        """The `model`-axis split of a variable, `None` if replicated."""
        return self.axes.get(id(variable))

    def data_axis(self, variable):
        """The ZeRO partition axis of a variable's shard, or `None`."""
        return self.data_axes.get(id(variable))

    def model_shard_shape(self, variable):
        """The shape of a placed variable's tensor-parallel shard."""
        shape = list(self.full_shapes[id(variable)])
        axis = self.axes[id(variable)]
        if axis is not None:
            shape[axis] //= self.tensor_parallel
        return tuple(shape)

    def local_shape(self, variable):
        """The shape one rank stores: its shard, and its ZeRO partition."""
        shape = list(self.model_shard_shape(variable))
        data_axis = self.data_axes.get(id(variable))
        if data_axis is not None:
            shape[data_axis] //= self.data_parallel
        return tuple(shape)

    def partition_axis(self, variable):
        """The axis ZeRO partitions a variable's shard on, or `None`.

        The first axis that the data-parallel size divides; a variable with
        none (a bias of odd size, a scalar) stays whole on every rank.
        """
        for axis, size in enumerate(self.model_shard_shape(variable)):
            if size % self.data_parallel == 0:
                return axis
        return None

    def piece_index(self, variable, model_rank, data_rank):
        """Where the piece of rank `(model_rank, data_rank)` sits in the
        full value: `((start, stop), ...)`, one pair per axis.

        The model rank's shard is cut first, then the data rank's ZeRO
        partition of that shard, as every runtime stores them.
        """
        index = [(0, size) for size in self.full_shapes[id(variable)]]
        for axis, rank, parts in (
            (self.axes[id(variable)], model_rank, self.tensor_parallel),
            (self.data_axes.get(id(variable)), data_rank, self.data_parallel),
        ):
            if axis is not None:
                start, stop = index[axis]
                size = (stop - start) // parts
                index[axis] = (start + rank * size, start + (rank + 1) * size)
        return tuple(index)

    def holds_first_copy(self, variable, model_rank, data_rank):
        """Whether no lower rank holds the same piece of `variable`.

        A replicated variable's first copy is rank `(0, 0)`'s, an
        unpartitioned shard's the data rank 0's: writing only first copies
        writes every number once.
        """
        if self.axes[id(variable)] is None and model_rank:
            return False
        return id(variable) in self.data_axes or not data_rank

    def stored(self, variable, value):
        """A full (canonical) `value` of `variable` in the layout its
        storage holds: permuted where it is split by blocks."""
        blocks = self.blocks.get(id(variable), 1)
        if blocks == 1:
            return value
        axis = self.axes[id(variable)]
        return blocked.to_stored(value, axis, self.tensor_parallel, blocks)

    def canonical(self, variable, value):
        """`stored` undone: the full value of `variable` in its layer's
        own layout, from the layout its storage holds."""
        blocks = self.blocks.get(id(variable), 1)
        if blocks == 1:
            return value
        axis = self.axes[id(variable)]
        return blocked.to_canonical(value, axis, self.tensor_parallel, blocks)

    def piece_runs(self, variable, model_rank, data_rank):
        """The runs of rank `(model_rank, data_rank)`'s piece that are
        contiguous in the full value: one for a variable not split by
        blocks, one per block (at most) for one that is.

        Returns:
            `[(local, index)]`: the run's slices of the piece (a tuple of
            `slice`s), and where it sits in the full value
            (`((start, stop), ...)`, as `piece_index`).
        """
        index = self.piece_index(variable, model_rank, data_rank)
        return self.index_runs(variable, index)

    def index_runs(self, variable, index):
        """`piece_runs` of the stored piece at `index` (`((start, stop),
        ...)`, where it sits in the stored layout)."""
        blocks = self.blocks.get(id(variable), 1)
        whole = tuple(slice(None) for _ in index)
        if blocks == 1:
            return [(whole, index)]
        axis = self.axes[id(variable)]
        start, stop = index[axis]
        size = self.full_shapes[id(variable)][axis]
        runs = []
        for (first, last), run in blocked.canonical_ranges(
            start, stop, size, self.tensor_parallel, blocks
        ):
            local, where = list(whole), list(index)
            local[axis] = slice(first - start, last - start)
            where[axis] = run
            runs.append((tuple(local), tuple(where)))
        return runs

    def full_value(self, variable):
        """The unsplit value of a placed variable, as a NumPy array."""
        return self.storage.full_value(variable)

    def assign_full_value(self, variable, value):
        """Assigns an unsplit `value` to a placed variable."""
        self.storage.assign_full_value(variable, value)
