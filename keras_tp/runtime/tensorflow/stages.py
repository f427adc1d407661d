"""The stage primitives of TensorFlow pipelines: replica steps of stages."""

import contextlib

import tensorflow as tf

from keras_tp.collectives.tensorflow_sequence import SequenceShard
from keras_tp.pipeline.executor import StagePrimitives
from keras_tp.pipeline.executor import join_rows
from keras_tp.pipeline.executor import run_forward
from keras_tp.pipeline.executor import run_schedule
from keras_tp.pipeline.executor import split_rows
from keras_tp.pipeline.schedules import BACKWARD
from keras_tp.pipeline.schedules import FORWARD
from keras_tp.runtime.tensorflow import added_losses
from keras_tp.tensors import carried_masks
from keras_tp.tensors import counted_once
from keras_tp.tensors import floats_of


class TensorFlowStages(StagePrimitives):
    """The stage primitives of a `TensorFlowPipelineRuntime`: each action
    one `strategy.run` of its stage's runtime in one traced step, chained
    to its stage's previous one (so 1F1B bounds the activations held).
    Replica `(d, t)` of a stage exchanges values with replica `(d, t)` of
    the next: a value crossing a cut is a list of one structure per
    replica, in order `d * T + t`. A training step leaves
    `gradients[stage, replica]`, summed over the micro-batches."""

    def __init__(self, pipeline, num_microbatches):
        super().__init__(pipeline, num_microbatches)
        self.stage_models = pipeline.stage_models
        self.runtimes = pipeline.stage_runtimes
        self.replicas = pipeline.data_parallel
        self.tensor_parallel = pipeline.tensor_parallel
        # Per stage, the whole length of each output a replica sends as
        # its sequence shard's slice, else `None`; read when traced.
        self._lengths = {}

    def step(self, x, y):
        """`run_schedule` of one batch."""
        self._tapes, self.gradients, self._ends, self.times = {}, {}, {}, []
        # Per micro-batch, the last stage's replicas' loss gradients.
        self._loss_cotangents = {}
        self._previous = [[] for _ in self.stage_models]
        self.added = []  # lists of one per replica
        result = run_schedule(self, self.order, x, y)
        self.pipeline.step_times.assign(
            tf.stack([tf.stack(t) for t in self.times])
        )
        return result

    def predict(self, x, training=False):
        """`run_forward` of the batch `x`."""
        self._training = training
        self.added = []
        return run_forward(self, x)

    def forward(self, stage, m, inputs, target):
        adding = self.pipeline.adding_stages[stage]
        with self._issued(stage, FORWARD, m, inputs) as (started, done):

            def forward():
                replica = self.runtimes[stage].replica_id()
                with tf.control_dependencies([started]):
                    received = tf.nest.map_structure(
                        tf.identity, inputs[replica]
                    )
                with tf.GradientTape() as tape:
                    tape.watch(floats_of(received))
                    outputs, added = self._added_call(stage, received, True)
                    share = added / self.num_microbatches if adding else None
                self._tapes[stage, m, replica] = (
                    tape,
                    received,
                    [*floats_of(outputs), share] if adding else outputs,
                )
                return outputs, added

            outputs = self._replica_outputs(stage, forward)
            done.extend(self.added[-1] if adding else ())
            predicted = None if target is None else outputs
            if target is not None:
                outputs = self._row_losses(m, outputs, target)
            done.extend(t for t in tf.nest.flatten(outputs) if t is not None)
        return outputs, predicted

    def backward(self, stage, m, cotangent):
        variables = self.stage_models[stage].trainable_variables
        received = cotangent or []
        with self._issued(stage, BACKWARD, m, received) as (started, done):
            cotangent = cotangent or self._loss_cotangents.pop(m)
            added = [self._seed()] if self.pipeline.adding_stages[stage] else []

            def backward():
                replica = self.runtimes[stage].replica_id()
                tape, inputs, outputs = self._tapes.pop((stage, m, replica))
                sources = floats_of(inputs) if stage else []
                with tf.control_dependencies([started]):
                    # A replica returns tensors only: zeros, not `None`.
                    grads = tape.gradient(
                        floats_of(outputs),
                        [*variables, *sources],
                        output_gradients=[*cotangent[replica], *added],
                        unconnected_gradients=tf.UnconnectedGradients.ZERO,
                    )
                self._accumulate((stage, replica), grads[: len(variables)])
                return grads[len(variables) :], self.gradients[stage, replica]

            results = self._replica_results(stage, backward)
            done.extend(tf.nest.flatten(results))
        return [sent for sent, _ in results]

    def infer(self, stage, inputs):
        def call():
            received = inputs[self.runtimes[stage].replica_id()]
            outputs, added = self._added_call(stage, received, self._training)
            if stage == self.num_stages - 1:
                outputs = (outputs, carried_masks(outputs))
            return outputs, added

        return self._replica_outputs(stage, call)

    def _added_call(self, stage, inputs, training):
        """`(outputs, total of the losses added, or zero)` of a replica's
        call of `stage`. The last stage's outputs are whole; a sequence
        shard crosses the cut as this rank's slice, a shard again for the
        next stage's replica of the same rank (as Megatron-LM sends it)."""
        model, runtime = self.stage_models[stage], self.runtimes[stage]
        with added_losses.recorded(model) as added, runtime.sequence_shards():
            if stage:
                inputs = tf.nest.map_structure(
                    _as_shard, inputs, self._lengths[stage - 1]
                )
            outputs = model(inputs, training=training)
            if stage == self.num_stages - 1:
                outputs = runtime.whole_outputs(outputs)
            else:
                self._lengths[stage] = tf.nest.map_structure(_length, outputs)
                outputs = tf.nest.map_structure(_local, outputs)
        losses = added + added_losses.penalties(model)
        total = self.pipeline.added_total(stage, losses)
        return outputs, tf.zeros(()) if total is None else total

    def joined(self, losses, predictions):
        # The mean of the rows' losses, each over an equal slice.
        rows = [row for micro in losses for row in micro]
        loss = self.joined_loss(rows, self.replicas) if rows else None
        # The batch's outputs, from the first replica of each row.
        rows = [micro[:: self.tensor_parallel] for micro in predictions]
        return loss, join_rows(rows)

    def _replica_outputs(self, stage, fn):
        """Per replica, the outputs of `fn`; the added losses it returns
        go to `added`."""
        outputs, added = map(list, zip(*self._replica_results(stage, fn)))
        if self.pipeline.adding_stages[stage]:
            self.added.append(added)
        return outputs

    def _replica_results(self, stage, fn):
        """`fn` run on each replica of `stage` (`reading_copies`)."""
        with self.pipeline.reading_copies(stage):
            return self.runtimes[stage].replica_results(
                fn, self.stage_models[stage]
            )

    def split(self, tree):
        """Per micro-batch, per replica, its part of `tree`."""
        tensor = self.tensor_parallel
        micros = split_rows(tree, self.replicas, self.num_microbatches)
        return [[row for row in rows for _ in range(tensor)] for rows in micros]

    def _row_losses(self, m, outputs, target):
        """Each data-parallel row's share of the batch's loss, outside the
        replicas (where Keras would divide a loss by their number); its
        gradient is kept for the row's backward passes."""
        # Read when traced: a model compiled again uses its new loss.
        loss_function = self.pipeline.loss_function(self.num_microbatches)
        losses, cotangents = [], []
        for first in range(0, len(outputs), self.tensor_parallel):
            predicted = floats_of(outputs[first])
            with tf.GradientTape() as tape:
                tape.watch(predicted)
                loss, fraction = loss_function(target[first], outputs[first])
                seeded = loss * tf.cast(self._seed(), loss.dtype)
            losses.append((loss, fraction))
            cotangent = counted_once(
                predicted,
                tape.gradient(
                    seeded,
                    predicted,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                ),
            )
            cotangents.extend([cotangent] * self.tensor_parallel)
        self._loss_cotangents[m] = cotangents
        return losses

    def _seed(self):
        """The loss's gradient (`PipelineRuntime.loss_seed`)."""
        return tf.cast(self.pipeline.loss_seed(), "float32")

    def _accumulate(self, key, grads):
        """Adds `grads` to `gradients[key]`, dense."""
        dense = [tf.convert_to_tensor(g) for g in grads]
        if key in self.gradients:
            dense = [a + b for a, b in zip(self.gradients[key], dense)]
        self.gradients[key] = dense

    @contextlib.contextmanager
    def _issued(self, stage, kind, m, inputs):
        """Issues the action `(stage, kind, m)` after its stage's previous
        one, timed from `start`, a `tf.timestamp` after its inputs and
        their sender's action (which each replica's thread waits for), to
        one after the tensors added to `done`; yields `(start, done)`."""
        sender = stage - 1 if kind == FORWARD else stage + 1
        sent = self._ends.get((sender, kind, m))
        waits = tf.nest.flatten(inputs) + ([sent] if sent is not None else [])
        with (
            tf.device(self.runtimes[stage].devices[0]),
            tf.control_dependencies(self._previous[stage]),
        ):
            with tf.control_dependencies(waits):
                start = tf.timestamp()
            self.times.append([start])
            with tf.control_dependencies([start]):
                done = []
                yield start, done
                self._previous[stage] = done
                with tf.control_dependencies(done):
                    self._ends[stage, kind, m] = end = tf.timestamp()
                self.times[-1].append(end)


def _length(value):
    """A sequence shard's whole length, else `None`."""
    return value.length if isinstance(value, SequenceShard) else None


def _local(value):
    """A sequence shard's slice, else `value`."""
    return value.local if isinstance(value, SequenceShard) else value


def _as_shard(value, length):
    """`value`, a received slice, as a sequence shard where `length`."""
    return (
        value if length is None else SequenceShard(local=value, length=length)
    )
