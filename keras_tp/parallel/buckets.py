"""Gradient buckets: variables whose gradients travel in one collective.

Gradients are bucketed as DDP and ZeRO bucket them: in reverse order (the
order they become ready in the backward pass), at most `bucket_cap_mb` per
collective call, partitioned variables apart from whole ones. A bucket
flattens its gradients into one tensor, runs one collective over the
`data` axis, and splits the result back into the variables' shapes.
"""

import math

import numpy as np
from keras import ops

from keras_tp.tensors import nbytes


class PlainCodec:
    """Gradients travel as they are: the codec without compression.

    A codec is what a bucket's collectives send and how (see
    `compression.py` for the compressed ones):

    - `all_reduce(bucket, values, adapter)`: the bucket's `values`
      averaged over `adapter`'s axis;
    - `reduce_scatter(rows, adapter)`: this rank's row of the average of
      `rows`, where `scatters` is true (else the bucket all-reduces and
      keeps its partition);
    - `variables`: the optimizer variables the codec keeps.
    """

    scatters = True
    variables = ()

    def all_reduce(self, bucket, values, adapter):
        return all_reduce_flat(values, adapter, bucket.cap_bytes)

    def reduce_scatter(self, rows, adapter):
        return adapter.reduce_scatter(rows, axis=0, op="mean")


PLAIN = PlainCodec()


class Bucket:
    """Variables whose gradients travel in one collective call.

    Args:
        index: position of the bucket (the first is synchronised first).
        variables: the variables, in order.
        partition_axes: per variable, the axis partitioned over the data
            axis, or `None` for all of them (an all-reduce bucket).
        shapes: per variable, the shape of its tensor-parallel shard.
        nbytes: bytes of those shards together.
        cap_bytes: the most bytes of one all-reduce call.
    """

    def __init__(
        self, index, variables, partition_axes, shapes, nbytes, cap_bytes
    ):
        self.index = index
        self.variables = variables
        self.partition_axes = partition_axes
        self.shapes = shapes
        self.nbytes = nbytes
        self.cap_bytes = cap_bytes

    @property
    def partitioned(self):
        return self.partition_axes is not None

    def chunks(self, itemsize):
        """`[(start, stop)]` element ranges of at most `cap_bytes` each.

        An all-reduce bucket is one flat vector cut into equal calls, so a
        large variable can span two calls and the number of calls is
        exactly the bytes over the cap, rounded up.
        """
        total = sum(math.prod(s) for s in self.shapes)
        if not self.partitioned:
            return _chunks(total, itemsize, self.cap_bytes)
        return [(0, total)]

    def describe(self):
        """One entry per collective call of the bucket."""
        itemsize = nbytes(self.variables[0], (1,))
        edges = np.cumsum([0] + [math.prod(s) for s in self.shapes])
        entries = []
        for start, stop in self.chunks(itemsize):
            overlapping = np.sum((edges[:-1] < stop) & (edges[1:] > start))
            entries.append(
                {
                    "bucket": self.index,
                    "mb": (stop - start) * itemsize / 2**20,
                    "variables": int(overlapping),
                    "collective": (
                        "reduce_scatter" if self.partitioned else "all_reduce"
                    ),
                }
            )
        return entries

    def indices(self, variables):
        """Positions of the bucket's variables in `variables`."""
        position = {id(v): i for i, v in enumerate(variables)}
        return [position[id(v)] for v in self.variables]

    def all_reduce(self, grads, variables, out, adapter, codec=PLAIN):
        """Averages the bucket's gradients over `adapter`'s axis.

        Args:
            grads: the gradients of `variables`, in order.
            variables: the variables the gradients belong to.
            out: a list like `grads`; the bucket's entries are replaced.
            adapter: the collective adapter of the `data` axis.
            codec: how the gradients travel: as they are (`PLAIN`), by a
                compression's codec (`compression.py`), or by the backward
                pass's `BackwardOverlap`.
        """
        indices = self.indices(variables)
        averaged = codec.all_reduce(self, [grads[i] for i in indices], adapter)
        for i, value in zip(indices, averaged):
            out[i] = value

    def reduce_scatter(self, grads, variables, out, adapter, codec=PLAIN):
        """This rank's partition of the bucket's averaged gradients.

        Arguments as in `all_reduce`; `out` receives the partitions. A
        codec that cannot reduce-scatter (PowerSGD, signs) all-reduces its
        compressed form, and each rank keeps its partition.
        """
        parts = adapter.size()
        indices = self.indices(variables)
        if not codec.scatters:
            values = [grads[i] for i in indices]
            averaged = codec.all_reduce(self, values, adapter)
            for i, value, axis in zip(indices, averaged, self.partition_axes):
                out[i] = partition(value, axis, adapter.rank(), parts)
            return
        rows = self._as_rows(grads, indices, parts)
        local = codec.reduce_scatter(rows, adapter)
        for i, piece, axis, shape in self._partitions(local, indices, parts):
            part_shape = list(shape)
            part_shape[axis] //= parts
            out[i] = _from_rows(piece, axis, part_shape)

    def all_gather(self, partitions, variables, out, adapter):
        """Rebuilds the bucket's variables from all ranks' partitions.

        Args:
            partitions: per variable of `variables`, this rank's partition.
            variables: the variables, in order.
            out: a dict; receives `{index in variables: full value}`.
            adapter: the collective adapter of the `data` axis.
        """
        parts = adapter.size()
        indices = self.indices(variables)
        rows = adapter.all_gather(self._as_rows(partitions, indices, 1), axis=0)
        for i, piece, axis, shape in self._partitions(rows, indices, parts):
            out[i] = _from_rows(piece, axis, shape)

    def _as_rows(self, values, indices, parts):
        """The bucket's `values` side by side, as `parts` rows.

        Row `r` holds partition `r` of every value: the layout a
        reduce-scatter or all-gather over the first axis needs.
        """
        return ops.concatenate(
            [
                _as_rows(values[i], axis, parts)
                for i, axis in zip(indices, self.partition_axes)
            ],
            axis=1,
        )

    def _partitions(self, matrix, indices, parts):
        """`(index, block, axis, shape)` per variable, inverse of `_as_rows`.

        `matrix` has one column block per variable, `1/parts` of its size
        wide.
        """
        widths = [math.prod(s) // parts for s in self.shapes]
        return zip(
            indices,
            _split_columns(matrix, widths),
            self.partition_axes,
            self.shapes,
        )


def make_buckets(var_list, partition_axes, shard_shape, cap_bytes):
    """Groups variables into buckets of at most `cap_bytes`.

    Variables are taken in reverse order, as their gradients become ready
    in the backward pass; partitioned variables and whole ones go to
    separate buckets, as do dtypes.

    Args:
        var_list: the trainable variables.
        partition_axes: `{id(variable): ZeRO partition axis or None}`.
        shard_shape: function giving a variable's tensor-parallel shard
            shape.
        cap_bytes: the most bytes per collective call.

    Returns:
        A list of `Bucket`s, in the order they are synchronised.
    """
    open_buckets = {}
    closed = []
    for variable in reversed(var_list):
        axis = partition_axes[id(variable)]
        key = (axis is not None, variable.dtype)
        shape = shard_shape(variable)
        size = nbytes(variable, shape)
        current = open_buckets.get(key)
        # All-reduce buckets are cut into calls of `cap` bytes later.
        full = axis is not None and current is not None
        if full and current[3] + size > cap_bytes:
            closed.append(open_buckets.pop(key))
            current = None
        if current is None:
            current = open_buckets[key] = ([], [], [], 0)
        variables, axes, shapes, total = current
        variables.append(variable)
        axes.append(axis)
        shapes.append(shape)
        open_buckets[key] = (variables, axes, shapes, total + size)
    closed.extend(open_buckets.values())
    return [
        Bucket(
            index,
            variables,
            axes if axes[0] is not None else None,
            shapes,
            total,
            cap_bytes,
        )
        for index, (variables, axes, shapes, total) in enumerate(closed)
    ]


def all_reduce_flat(tensors, adapter, cap_bytes, mean=None):
    """Averages `tensors` over `adapter`'s axis as one flat vector.

    The vector is cut into calls of at most `cap_bytes`, so the number of
    calls is exactly its bytes over the cap, rounded up.

    Args:
        tensors: tensors of one dtype.
        adapter: the collective adapter.
        cap_bytes: the most bytes of one call.
        mean: the average of one flat piece over the ranks; by default
            `adapter.all_reduce(piece, "mean")`.

    Returns:
        The averaged tensors, in their shapes.
    """
    if mean is None:

        def mean(piece):
            return adapter.all_reduce(piece, "mean")

    def start(piece):
        result = mean(piece)
        return lambda: result

    return start_all_reduce_flat(tensors, cap_bytes, start)()


def start_all_reduce_flat(tensors, cap_bytes, start):
    """Starts `all_reduce_flat`'s calls; returns a function finishing them.

    Args:
        tensors: tensors of one dtype.
        cap_bytes: the most bytes of one call.
        start: starts the average of one flat piece over the ranks and
            returns a function of no arguments that returns it (see
            `CollectiveAdapter.all_reduce_async`).

    Returns:
        A function of no arguments returning the averaged tensors, in
        their shapes.
    """
    flat = FlatPieces(
        [tuple(t.shape) for t in tensors], nbytes(tensors[0], (1,)), cap_bytes
    )
    flats = dict(enumerate(ops.reshape(t, (-1,)) for t in tensors))
    waits = [start(flat.piece(k, flats)) for k in range(len(flat.ranges))]
    return lambda: flat.assemble([wait() for wait in waits])


class FlatPieces:
    """Tensors as one flat vector, cut into pieces of at most `cap_bytes`.

    Piece `k` covers `ranges[k]` of the vector, so it can be made (and
    sent) as soon as the tensors it covers exist: the backward pass makes
    a bucket's gradients piece by piece (see `overlap.py`).

    Args:
        shapes: the tensors' shapes, in order.
        itemsize: bytes of one element.
        cap_bytes: the most bytes of one piece.
    """

    def __init__(self, shapes, itemsize, cap_bytes):
        self.shapes = list(shapes)
        sizes = [math.prod(s) for s in self.shapes]
        self.sizes = sizes
        self.edges = np.cumsum([0] + sizes).tolist()
        self.ranges = _chunks(sum(sizes), itemsize, cap_bytes)

    def covered(self, k):
        """Indices of the tensors piece `k` covers."""
        start, stop = self.ranges[k]
        return [
            i
            for i in range(len(self.sizes))
            if self.edges[i] < stop and self.edges[i + 1] > start
        ]

    def piece(self, k, flats):
        """Piece `k`, from `{index: flattened tensor}` of those it covers."""
        start, stop = self.ranges[k]
        parts = [
            flats[i][
                max(start, self.edges[i]) - self.edges[i] : min(
                    stop, self.edges[i + 1]
                )
                - self.edges[i]
            ]
            for i in self.covered(k)
        ]
        return ops.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    def assemble(self, pieces):
        """The tensors, in their shapes, from all of their pieces."""
        flat = ops.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        columns = _split_columns(ops.reshape(flat, (1, -1)), self.sizes)
        return [ops.reshape(p, s) for p, s in zip(columns, self.shapes)]


def partition(value, axis, rank, parts):
    """Partition `rank` of `parts` equal slices of `value` along `axis`."""
    shape = list(value.shape)
    shape[axis] //= parts
    start = [0] * len(shape)
    start[axis] = rank * shape[axis]
    return ops.slice(value, start, shape)


def _chunks(total, itemsize, cap_bytes):
    """`[(start, stop)]` ranges of at most `cap_bytes` over `total` items."""
    step = max(1, int(cap_bytes // itemsize))
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def _as_rows(x, axis, parts):
    """`x` as `parts` rows, row `r` holding partition `r` of `axis`."""
    return ops.reshape(ops.moveaxis(x, axis, 0), (parts, -1))


def _from_rows(rows, axis, shape):
    """Inverse of `_as_rows` for rows that rebuild a tensor of `shape`."""
    moved = [shape[axis]] + [d for i, d in enumerate(shape) if i != axis]
    return ops.moveaxis(ops.reshape(rows, moved), 0, axis)


def _split_columns(matrix, widths):
    """Splits a 2-D tensor into column blocks of the given widths."""
    edges = np.cumsum(widths)[:-1].tolist()
    return ops.split(matrix, edges, axis=1) if edges else [matrix]
