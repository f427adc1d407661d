"""Steps of the TensorFlow runtime: train, test and predict over the replicas.

Keras' TensorFlow trainer would run its step in every replica and treat the
replicas as data parallel: it splits each batch, divides the loss by the
number of replicas and sums the gradients over them. For tensor parallelism
the model is therefore not put under the strategy; Keras sees one device
and `run_step` runs the replicas itself: every replica computes the forward
pass on the same full batch, the loss and the metrics are computed once
from the (replicated) output, and the gradient of the loss with respect to
that output is sent back to every replica, which finishes the backward pass
and updates its own shards with the wrapped optimizer
(`TensorParallelOptimizer`). The loss is never scaled and no gradient goes
through the optimizer's all-reduce; the gradients of replicated variables
are broadcast from replica 0 (one collective per step) so that their copies
stay bit-identical.

With a data axis every row runs the forward pass on its slice of the
global batch; the loss and metrics are computed once, on the rows' outputs
put back together, so they are those of the global batch; each row receives
`D` times the gradient of the global loss with respect to its output (the
gradient of its own mean loss), and the `CoordinatedOptimizer` averages the
parameter gradients over the data axis, reduce-scatters them or gathers
partitions according to the ZeRO stage. Across workers, where a worker
holds only its own rows, the rows' outputs are first all-gathered over
`data` (`worker_rows`), so that every worker computes that same loss.

Where an LM head's logits stay split by vocabulary (`keras_tp.vocab_parallel`),
each replica computes the loss and accuracy of every token from its rows of
the vocabulary, and these per-token values stand for the output: the loss
outside the replicas reduces them, and its gradient with respect to them
flows back to each replica's logits. Steps with a data axis are always
traced, since the collective groups of the mesh axes only run in graphs.
"""

import warnings

import keras
import tensorflow as tf

from keras_tp.keras_internals import local_shapes
from keras_tp.keras_internals import losses_override
from keras_tp.keras_internals import tracked_loss
from keras_tp.runtime.tensorflow import added_losses
from keras_tp.runtime.tensorflow.optimizer import prepare_optimizer
from keras_tp.tensors import carried_masks
from keras_tp.tensors import counted_once
from keras_tp.tensors import with_masks
from keras_tp.vocab_parallel import split_head


class ReplicaSteps:
    """Runtime mixin: Keras' train, test and predict steps on the replicas."""

    def run_step(self, phase, step, *args, **kwargs):
        """Runs one train / test / predict step over the replicas.

        `step` is Keras' own step; it is not called, because it assumes data
        parallelism of another kind (see the module docstring). The
        runtime's step keeps its contract: same data format, same loss,
        metrics and optimizer of the compiled model, same returned logs or
        predictions.
        """
        model = step.__self__
        if model.jit_compile:
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs its replicas with "
                "tf.distribute, which XLA cannot compile as one program: "
                "call `compile(..., jit_compile=False)`."
            )
        if phase != "predict" and model.steps_per_execution > 1:
            # Keras loops such steps in a tf.while_loop, inside which
            # tf.distribute replicas fail to run (plain Keras too).
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs one step per "
                "execution: call `compile(..., steps_per_execution=1)`."
            )
        steps = {
            "train": self._train_step,
            "test": self._test_step,
            "predict": self._predict_step,
        }
        shares = self.reads_shares(phase)
        with self.adapter.stats.recording(phase):
            data = self._batch_of_first_worker(*args, shares=shares, **kwargs)
            return self._traced(steps[phase])(model, data)

    def _batch_of_first_worker(self, data, shares=False):
        """The batch every rank must see: worker 0's when there are several.

        Each worker process reads its own input; a shuffled order or other
        data on another worker would silently give its ranks other batches.
        One broadcast per input tensor (counted in the step's collectives)
        makes them all use worker 0's batch. A worker that reads its rows'
        `shares` of the global batch (`WorkerRows.data_row`) keeps them.
        """
        if len(self._local_replicas) == self.world_size or shares:
            return data
        # With a data axis the model axis spans part of the replicas.
        adapter = self.world_adapter if self.data_parallel > 1 else self.adapter
        leaves = tf.nest.flatten(data)
        positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def from_first_worker(*tensors):
            return [adapter.broadcast(t, root=0) for t in tensors]

        tensors = self._on_replicas(
            from_first_worker, *[leaves[i] for i in positions]
        )
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        return tf.nest.pack_sequence_as(data, leaves)

    def _forward(self, model, x, y, training, tapes=None, shares=False):
        """Runs the model on every replica, each row on its slice of `x`.

        Args:
            model: the `TensorParallelKeras` model.
            x: the global batch of inputs.
            y: the global batch of targets, read where the logits stay
                split by vocabulary.
            training: the `training` argument of the call.
            tapes: if given, each replica records its forward pass on a
                gradient tape kept here under its replica id.
            shares: whether `x` and `y` are this worker's share of the
                global batch (`WorkerRows.reads_shares`).

        Returns:
            `(outputs, added)`: the output of each data-parallel row (that
            of its first model rank; the others hold the same), in row
            order, where an LM head's logits stay split its per-token
            loss and metric values (`VocabParallelHead.per_token`); and
            each row's total of the losses its forward pass added
            (`added_losses`); across workers, those of every row
            (`WorkerRows.gathered_rows`).
        """
        if not shares:
            x = self._checked_split(x)
        head = split_head()

        def call(x, y):
            with self.sequence_shards(), added_losses.recorded(model) as added:
                outputs = self.whole_outputs(model(x, training=training))
            total = added_losses.replica_total(model, added)
            if head is None:
                # A mask does not leave a replica as an attribute.
                return outputs, total, carried_masks(outputs)
            return head.per_token(self.adapter, y, outputs), total, {}

        def forward(x, y):
            replica = self.replica_id()
            row = replica // self.tensor_parallel
            local_x, local_y = self._row_slice((x, y), row, shares)
            if tapes is None:
                return self.gathered_rows(*call(local_x, local_y))
            tape = tf.GradientTape()
            with tape:
                y_pred, total, masks = call(local_x, local_y)
            tapes[replica] = (tape, (y_pred, total))
            return self.gathered_rows(y_pred, total, masks)

        if head is None:
            y = None
        with self._local_shapes(model):
            results = self.strategy.run(forward, args=(x, y))
        local = self.strategy.experimental_local_results(results)
        firsts = local[:: self.tensor_parallel]
        if self.rows_span_workers:
            firsts = self.split_rows(*local[0])
        rows = [with_masks(y_pred, masks) for y_pred, _, masks in firsts]
        return rows, [total for _, total, _ in firsts]

    def _checked_split(self, x):
        """`x`, checked to split evenly over the data-parallel rows (when
        the step runs, where the batch size is unknown while tracing)."""
        parts = self.data_parallel

        def check(leaf):
            if leaf.shape[0] is not None:
                self.check_batch_size(leaf.shape[0])
                return leaf
            assertion = tf.debugging.assert_equal(
                tf.shape(leaf)[0] % parts,
                0,
                message=(
                    f"A batch cannot be split evenly over data_parallel="
                    f"{parts} ranks. Use a batch size (and a dataset size, "
                    f"or `drop_remainder=True`) that divides by {parts}."
                ),
            )
            with tf.control_dependencies([assertion]):
                return tf.identity(leaf)

        return self._map_batched(check, x)

    def _row_slice(self, x, row, shares=False):
        """Row `row`'s equal slice of every batched tensor of `x` (the
        global batch, or this worker's `shares` of it)."""
        index, parts = self.row_place(row, shares)

        def piece(leaf):
            size = leaf.shape[0]
            size = tf.shape(leaf)[0] // parts if size is None else size // parts
            return leaf[index * size : (index + 1) * size]

        return self._map_batched(piece, x)

    def _map_batched(self, fn, x):
        """`fn` on every batched tensor of `x`, with a data axis only."""
        if self.data_parallel == 1:
            return x

        def batched(leaf):
            if not tf.is_tensor(leaf) or leaf.shape.rank == 0:
                return leaf
            return fn(leaf)

        return tf.nest.map_structure(batched, x)

    def _rows_together(self, rows):
        """The global batch's outputs from the rows' outputs."""
        if len(rows) == 1:
            return rows[0]
        together = tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *rows
        )
        masks = [carried_masks(row) for row in rows]
        return with_masks(
            together,
            {i: tf.concat([m[i] for m in masks], 0) for i in masks[0]},
        )

    def _train_step(self, model, data):
        # Whether `data` is this worker's share of the global batch.
        shares = self.reads_shares("train")
        optimizer = prepare_optimizer(self, model)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # Each replica's forward tape, kept for its backward pass.
        tapes = {}
        rows, added = self._forward(
            model, x, y, training=True, tapes=tapes, shares=shares
        )
        if shares:
            y, sample_weight = self.global_targets(y, sample_weight)
        size = self.global_batch_size(_batch_size(x), shares)
        rows = list(zip(rows, added))
        # The loss is computed once, outside the replicas, on the global
        # batch, so Keras neither divides it by the number of replicas nor
        # averages it over them.
        with tf.GradientTape() as loss_tape:
            loss_tape.watch(rows)
            y_pred = self._rows_together([output for output, _ in rows])
            with (
                self.loss_from_outputs(model.model, loss_tape),
                _rows_added_losses(model, [total for _, total in rows]),
            ):
                loss = tracked_loss(
                    model, x, y, y_pred, sample_weight, True, size
                )
            scaled_loss = optimizer.scale_loss(loss)
        # Times D, the gradient with respect to a row's output is that of
        # the row's own mean loss; the CoordinatedOptimizer's average over
        # `data` then makes the gradient of the global loss, for any loss.
        row_gradients = [
            tf.nest.map_structure(
                lambda g: g * tf.cast(self.data_parallel, g.dtype), gradient
            )
            for gradient in counted_once(
                rows,
                loss_tape.gradient(
                    scaled_loss,
                    rows,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                ),
            )
        ]

        def backward_and_update(row_gradients):
            replica = self.replica_id()
            tape, local_y_pred = tapes.pop(replica)
            variables = model.trainable_variables
            gradients = tape.gradient(
                local_y_pred,
                variables,
                output_gradients=row_gradients[replica // self.tensor_parallel],
            )
            self.apply_on_replica(optimizer, gradients, variables, model)

        if model.trainable_variables:
            with self._local_shapes(model):
                self.strategy.run(backward_and_update, args=(row_gradients,))
        else:
            warnings.warn("The model does not have any trainable weights.")
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def replica_results(self, fn, model, *args):
        """Runs `fn(*args)` on every replica, `model`'s variables at their
        local shapes.

        Returns:
            Each replica's result, in replica order.
        """
        with self._local_shapes(model):
            results = self.strategy.run(fn, args=args)
        replicas = len(self._local_replicas)
        columns = []
        for leaf in tf.nest.flatten(results):
            local = self.strategy.experimental_local_results(leaf)
            # A tensor every replica returned as it is (an input passed
            # through) comes back once.
            columns.append(local * replicas if len(local) == 1 else local)
        return [
            tf.nest.pack_sequence_as(results, [c[r] for c in columns])
            for r in range(replicas)
        ]

    def run_on_ranks(self, fn, variables, phase):
        """Runs `fn()` in every replica, traced as steps are.

        The collective groups of a data axis only run in graphs, and each
        replica reads and assigns its own components of `variables`.
        """
        placed = [v for v in variables if self.placement.is_placed(v)]

        def on_replica():
            fn()
            # `strategy.run` needs a result to return.
            return tf.zeros(())

        with (
            self.adapter.stats.recording(phase),
            local_shapes(placed, self.placement.local_shape),
        ):
            self._on_replicas(on_replica)

    def run_split_function(self, function, args, split_axes, output_axis=None):
        """Inside a replica, `function` of its values; outside (the loss
        and metrics of split logits), `function`'s per-token values, which
        the replicas computed from their logits in the step's forward pass
        (see `_forward`): the output the loss and metrics read holds them
        in place of the logits."""
        if self.holds_local_values():
            return super().run_split_function(
                function, args, split_axes, output_axis
            )
        return split_head().column(function, args[1])

    def _test_step(self, model, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, added = self._padded_forward(model, x, y)
        with _rows_added_losses(model, added):
            _tracked_loss(model, x, y, y_pred, sample_weight, False)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _predict_step(self, model, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._padded_forward(model, x)[0]

    def _padded_forward(self, model, x, y=None):
        """`(outputs, added)` of an inference pass on a batch of any size
        (as `_forward`'s): with a data axis, its last row repeated up to a
        multiple of `data_parallel`, then dropped
        (`keras_tp.runtime.padding`)."""
        size, parts = _batch_size(x), self.data_parallel

        def pad(leaf):
            if parts == 1 or not tf.is_tensor(leaf) or leaf.shape.rank == 0:
                return leaf
            rows = tf.shape(leaf)[0]
            indices = tf.range(rows + tf.math.floormod(-rows, parts))
            return tf.gather(leaf, tf.minimum(indices, rows - 1))

        x, y = tf.nest.map_structure(pad, (x, y))
        rows, added = self._forward(model, x, y, False)
        outputs = tf.nest.map_structure(
            lambda out: out[:size] if out.shape.rank else out,
            self._rows_together(rows),
        )
        return outputs, added


def _tracked_loss(model, x, y, y_pred, sample_weight, training):
    """The global batch's loss, added to the mean loss `fit()` reports."""
    return tracked_loss(
        model, x, y, y_pred, sample_weight, training, _batch_size(x)
    )


def _rows_added_losses(model, added):
    """Inside, `model.losses` is the rows' mean of the losses their forward
    passes `added`, as DDP averages its ranks'."""
    return losses_override(model, [tf.add_n(added) / len(added)])


def _batch_size(x):
    first = next(i for i in tf.nest.flatten(x) if i is not None)
    return tf.shape(first)[0]
