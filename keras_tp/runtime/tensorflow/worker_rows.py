"""Data-parallel rows on the replicas of several TensorFlow workers.

On one host every data-parallel row runs in the process, and the step puts
the rows' outputs together outside the replicas to compute the loss of the
global batch (see `keras_tp.runtime.tensorflow.steps`). Across the workers
of a `MultiWorkerMirroredStrategy` a worker holds only its own rows. The
step keeps the same design, so that its results are one host's to float
precision for any loss: inside the replicas each row's outputs (and the
losses its forward pass added) are all-gathered over the `data` axis, one
counted collective per tensor; every worker then computes the same loss
of the global batch from them, and each row takes its own slice of the
gradient with respect to the outputs. The gradient of a row's parameters
is then averaged over `data` by the `CoordinatedOptimizer`, as on one
host.

Where each worker's rows read only their share of every global batch
(`data_row`, `keras_tp.data_shares`: a `tf.data.Dataset` in `fit()`), the
targets and sample weights of the shares are all-gathered too, for the
loss and the metrics of the global batch, and the inputs are never sent
(a `compute_metrics` or `compute_loss` of your own gets this worker's
share of `x`; Keras' own do not read it).
Otherwise (NumPy arrays, `evaluate()`, `predict()`) every worker reads
the global batch, and worker 0's is broadcast, as for tensor parallelism.
"""

import tensorflow as tf


class WorkerRows:
    """Runtime mixin: the data-parallel rows a worker holds, and their
    outputs put together across workers."""

    @property
    def rows_span_workers(self):
        """Whether the data-parallel rows run on several workers."""
        return (
            self.data_parallel > 1
            and len(self._local_replicas) < self.world_size
        )

    def data_row(self):
        """`(share, shares)`: this worker's rows read the `share`-th
        `1/shares` of each global batch; `None` on one host, or where a
        worker's replicas do not hold whole rows or a part of one row."""
        if not self.rows_span_workers:
            return None
        first, count = self._rows_here()
        if count * self.tensor_parallel != len(self._local_replicas) and (
            self.tensor_parallel % len(self._local_replicas)
        ):
            return None
        return first // count, self.data_parallel // count

    def _rows_here(self):
        """`(first, count)`: the data-parallel rows this worker's replicas
        belong to."""
        rows = sorted({r // self.tensor_parallel for r in self._local_replicas})
        return rows[0], len(rows)

    def reads_shares(self, phase):
        """Whether the batches of a `phase` step are this worker's share of
        the global batch: in training only (`keras_tp.data_shares` shares
        `fit()`'s `x`, never its validation data)."""
        return (
            phase == "train"
            and self.batches_are_shares
            and self.data_row() is not None
        )

    def row_place(self, row, shares):
        """`(index, parts)`: row `row` computes the `index`-th of `parts`
        equal slices of the batch a step got (the global batch, or this
        worker's share of it)."""
        if not shares:
            return row, self.data_parallel
        first, count = self._rows_here()
        return row - first, count

    def global_batch_size(self, size, shares):
        """The size of the global batch of which a step got `size`
        samples."""
        if not shares:
            return size
        return size * self.data_parallel // self._rows_here()[1]

    def gathered_rows(self, outputs, total, masks):
        """Inside a replica: every row's `outputs`, added-loss `total`
        and `masks`, all-gathered over `data` where the rows span workers.

        A total known when traced (no loss added) is every row's, so it is
        not sent.
        """
        if not self.rows_span_workers:
            return outputs, total, masks
        outputs, masks = tf.nest.map_structure(
            self._rows_gathered, (outputs, masks)
        )
        if tf.get_static_value(total) is None:
            total = self._rows_gathered(tf.reshape(total, [1]))
        else:
            total = tf.fill([self.data_parallel], total)
        return outputs, total, masks

    def _rows_gathered(self, tensor):
        """Every row's `tensor`, concatenated in row order; a boolean one
        (a Keras mask) travels as integers, which collectives take."""
        if tensor.dtype == tf.bool:
            return tf.cast(
                self._rows_gathered(tf.cast(tensor, tf.int32)), tf.bool
            )
        return self.data_adapter.all_gather(tensor, axis=0)

    def split_rows(self, outputs, totals, masks):
        """The rows' `(outputs, totals, masks)`, in row order, from those of
        `gathered_rows` on one replica."""
        parts = self.data_parallel
        pieces = [
            tf.split(leaf, parts, axis=0) for leaf in tf.nest.flatten(outputs)
        ]
        mask_pieces = {i: tf.split(m, parts, axis=0) for i, m in masks.items()}
        return [
            (
                tf.nest.pack_sequence_as(outputs, [p[row] for p in pieces]),
                totals[row],
                {i: m[row] for i, m in mask_pieces.items()},
            )
            for row in range(parts)
        ]

    def global_targets(self, y, sample_weight):
        """`(y, sample_weight)` of the global batch, from this worker's
        shares: each tensor all-gathered over `data` (counted)."""
        leaves = tf.nest.flatten((y, sample_weight))
        positions = [
            i
            for i, leaf in enumerate(leaves)
            if tf.is_tensor(leaf) and leaf.shape.rank
        ]
        if not positions:
            return y, sample_weight
        first, count = self._rows_here()

        def gathered(*tensors):
            # Each row of this worker sends its slice of the share.
            row = self.replica_id() // self.tensor_parallel
            index = row - first
            return [
                self._rows_gathered(tf.split(t, count, axis=0)[index])
                for t in tensors
            ]

        results = self._on_replicas(gathered, *[leaves[i] for i in positions])
        for position, tensor in zip(positions, results):
            leaves[position] = tensor
        return tf.nest.pack_sequence_as((y, sample_weight), leaves)
