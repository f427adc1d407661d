"""Sharded regions of the TensorFlow runtime, in and outside the replicas.

Inside a replica a sharded layer runs on the local weights with the
collectives of `TensorFlowCollectiveAdapter`. `TensorParallelKeras` runs
its direct calls in the replicas too. A sharded layer called outside them
(the wrapped model called itself, say) runs as its own small replica step,
and its split outputs are gathered (these gathers are counted in the
`"call"` phase); this path gives exact outputs but no gradients.
"""

import contextlib

import tensorflow as tf

from keras_tp.collectives.tensorflow_sequence import SequenceShard
from keras_tp.collectives.tensorflow_sequence import gathered
from keras_tp.collectives.tensorflow_sequence import shards_of
from keras_tp.collectives.tensorflow_sequence import whole_tensors
from keras_tp.regions import forward_pass
from keras_tp.runtime.tensorflow.storage import local_read


class ReplicaRegions:
    """Runtime mixin: runs sharded regions and ZeRO-3 gathered calls."""

    # The model whose training loss is being computed, outside the
    # replicas (`loss_from_outputs`).
    _loss_of = None

    def prepare_region(self, region):
        """Lets the region's Row layers take their input split."""
        region.accept_split_input()

    def holds_local_values(self):
        return self._in_replica()

    def call_model(self, model, inputs, training):
        """A direct call of the wrapped model (`tp(x)`).

        The whole call runs in every replica, traced, as a step does: the
        mesh axes' collectives, ZeRO-3's gathers and the split variables of
        layers outside any region exist there only. Each data-parallel row
        computes the whole batch.
        """
        if self._in_replica():
            # A custom loop's replica step: values are the replica's own.
            with self._local_shapes(model), self.sequence_shards():
                outputs = super().call_model(model, inputs, training)
                return self.whole_outputs(outputs)

        def call_on_replica(inputs):
            with forward_pass(), self.sequence_shards():
                return self.whole_outputs(model(inputs, training=training))

        with self.recording_call():
            return self._on_replicas(call_on_replica, inputs)

    @contextlib.contextmanager
    def loss_from_outputs(self, model, tape):
        """The context of a training step's loss, which is computed outside
        the replicas from their outputs (see `keras_tp.runtime.tensorflow.
        steps`): no gradient would reach a layer that the model's own
        `compute_loss` calls again there, so such a call is refused."""
        self._loss_of = model
        try:
            yield
        finally:
            self._loss_of = None
        read = {id(v) for v in tape.watched_variables()}
        for variable in model.trainable_variables:
            # A variable of the replicas is read through its copies.
            copies = getattr(variable.value, "values", (variable.value,))
            if any(id(copy) in read for copy in copies):
                _refuse_loss_of(model, f"reads variable '{variable.path}'")

    def run_region(self, region, args, kwargs):
        if self._loss_of is not None:
            _refuse_loss_of(self._loss_of, f"calls layer '{region.layer.path}'")
        if not self._in_replica():
            return self._region_outside_replicas(region, args, kwargs)
        if not self.sequence_parallel:
            return self.run_local_region(region, args, kwargs)
        if not region.parallel_input:
            args, kwargs = whole_tensors((args, kwargs))
        return self.run_local_region(
            region, args, kwargs, enter=self._enter_from_sequence
        )

    def _enter_from_sequence(self, x):
        """A region's replicated input, read by split weights: a sequence
        shard all-gathered (its gradient, each rank's partial sum,
        reduce-scattered; the split weights' gradients gather it again),
        any other through `copy_to_parallel`."""
        if isinstance(x, SequenceShard):
            return gathered(self.adapter, x)
        return self.adapter.copy_to_parallel(x)

    @contextlib.contextmanager
    def sequence_shards(self):
        """The context of a replica's forward pass: under sequence
        parallelism, the shards between the regions are split over this
        runtime's `model` ranks (`keras_tp.collectives.tensorflow_sequence`)."""
        if not self.sequence_parallel:
            yield
            return
        with shards_of(self.adapter.inner):
            yield

    def whole_outputs(self, outputs):
        """A replica's model outputs with every sequence shard gathered."""
        if not self.sequence_parallel:
            return outputs
        return whole_tensors(outputs)

    @contextlib.contextmanager
    def _gathered_partitions(self, layer, variables, axes):
        """Gathers the partitions inside a replica, once per step.

        The tape keeps the gathered parameters for the backward pass, so
        they are gathered once per step (2 x the parameters communicated,
        not the 3 x of re-gathering), and stay alive from the layer's
        forward to its backward.
        """
        if not self._in_replica():
            raise RuntimeError(
                f"Layer '{layer.path}' holds ZeRO-3 partitions, which "
                "are gathered only inside its TensorParallelKeras model: "
                "call the model, or use predict()."
            )
        gather = self.data_adapter.gather_partitions
        yield [gather(local_read(v), axis) for v, axis in zip(variables, axes)]

    def local_value(self, variable):
        return local_read(variable)

    def split_on_model(self, value, axis):
        """In a replica, its slice; outside the replicas, where each region
        runs as its own replica step and gathers its outputs, the tensor
        stays whole (a region that takes it split scatters it)."""
        if not self._in_replica():
            return value
        return super().split_on_model(value, axis)

    def _region_outside_replicas(self, region, args, kwargs):
        """Runs the region as its own replica step and gathers its outputs."""
        leaves = tf.nest.flatten((args, kwargs))
        tensor_positions = [
            i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)
        ]
        split = region.split_inputs(args, kwargs)
        output_axes = region.output_axes(args, kwargs)

        def replica_step(*tensors):
            local = list(leaves)
            for position, tensor in zip(tensor_positions, tensors):
                axis = split.get(id(leaves[position]))
                if axis is not None:
                    tensor = self.adapter.scatter_to_parallel(tensor, axis)
                local[position] = tensor
            local_args, local_kwargs = tf.nest.pack_sequence_as(
                (args, kwargs), local
            )
            outputs = self.run_local_region(region, local_args, local_kwargs)
            return _gather_split(self.adapter, outputs, output_axes)

        @tf.custom_gradient
        def sharded_call(*tensors):
            def grad(*upstream, variables=None):
                raise NotImplementedError(
                    f"Layer '{region.layer.path}' was called directly, outside "
                    "a TensorParallelKeras step, where keras_tp computes no "
                    "gradients on TensorFlow. Train with fit() or "
                    "train_on_batch()."
                )

            return self._on_replicas(replica_step, *tensors), grad

        return sharded_call(*[leaves[i] for i in tensor_positions])


def _refuse_loss_of(model, what):
    raise NotImplementedError(
        f"{type(model).__name__}.compute_loss {what} of the model: on "
        "TensorFlow keras_tp computes a training step's loss outside the "
        "replicas, from the outputs of their forward pass, where a layer "
        "called again would get no gradient. Train this model on JAX or "
        "torch, or compute its loss from `y_pred` alone."
    )


def _gather_split(adapter, outputs, axes):
    """Gathers each output left split along its axis (`None`: replicated)."""
    if axes is None:
        return outputs
    if isinstance(axes, int):
        return adapter.all_gather(outputs, axes)
    return type(outputs)(
        _gather_split(adapter, o, a) for o, a in zip(outputs, axes)
    )
