"""Pipelines on torch: each rank runs its shard of one stage of one
replica."""

import itertools

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.collectives.torch import TorchCollectiveAdapter
from keras_tp.collectives.torch import is_symbolic
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.parallel.loss_scaling import unscaled
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.mesh import MeshRuntime
from keras_tp.runtime.torch import TorchRuntime
from keras_tp.runtime.torch.devices import join_ranks
from keras_tp.runtime.torch.devices import mesh_groups
from keras_tp.runtime.torch.devices import rank_devices
from keras_tp.runtime.torch.devices import this_device
from keras_tp.runtime.torch.sequence import SequenceShards
from keras_tp.runtime.torch.stage_storage import StageStorage
from keras_tp.runtime.torch.stages import TorchStages
from keras_tp.runtime.torch.stages import grad_or_zeros
from keras_tp.runtime.torch.storage import RankProcess


class TorchStageRuntime(TorchRuntime):
    """The `TorchRuntime` of this rank's stage, over the process `groups`
    of its `model` axis, its `data` axis and both. A `global_clipnorm`
    takes the norm over every rank (`job_adapter`), the `copies` (ids of
    an earlier stage's weights) counted at their owner only."""

    # The stage storage places variables without their blocks.
    stores_blocks = False

    def __init__(self, config, groups, job_adapter, copies):
        self._groups = groups
        self._job_adapter = job_adapter
        self._copies = copies
        # Not TorchRuntime's constructor: the process group is joined.
        MeshRuntime.__init__(self, config)
        if self.sequence_parallel:
            self._sequence = SequenceShards(self.adapter.inner, self._regions)

    def _axis_groups(self):
        return self._groups

    def bind_optimizer(self, optimizer):
        super().bind_optimizer(optimizer)
        optimizer.clipping.bind(
            self.placement,
            self.world_adapter,
            within_replica=False,
            global_world=self._job_adapter,
            copies=self._copies,
        )


class TorchPipelineRuntime(RankProcess, StageStorage, PipelineRuntime):
    """Runs Keras' torch steps as pipelines on a row-major `data x pipe x
    model` mesh of ranks: rank `(d, p, t)` runs shard `t` of stage `p` of
    replica `d`, which trains on the `d`-th slice of every batch."""

    backend = "torch"
    # Each rank runs the code between split layers on its own tensors.
    local_ranks = True

    def __init__(self, model, config):
        join_ranks(
            config.requested_world_size,
            counted=(
                f" (pipeline_parallel={config.pipeline_parallel} x "
                f"data_parallel={config.data_parallel} x the tensor-parallel "
                "ranks of a stage; one rank per stage without world_size)"
            ),
        )
        self.rank = dist.get_rank()
        self.device = this_device()
        super().__init__(model, config)
        mesh = self.device_mesh
        self.data_index, self.stage_index, _ = (
            int(i) for i in np.unravel_index(self.rank, mesh.shape)
        )
        shape = dict(zip(mesh.axis_names, mesh.shape))
        model_group, self.pipe_group, data_group, stage_group = mesh_groups(
            shape, "model", "pipe", "data", ("data", "model")
        )
        # This replica's and tensor-parallel rank's stages.
        self.pipe_adapter = self._counted_adapter(self.pipe_group, "pipe")
        # A loss scale's finiteness check spans every rank.
        self.world_adapter = self._counted_adapter(
            None, ("data", "pipe", "model")
        )
        self.stage_model = self.stage_models[self.stage_index]
        copies = {
            id(v)
            for v in self.stage_model.trainable_variables
            if self.stage_of[id(v)] != self.stage_index
        }
        self.stage_runtime = self.counted(
            TorchStageRuntime(
                self.config.stage_config(self.stage_devices[self.stage_index]),
                (model_group, data_group, stage_group),
                self.world_adapter,
                copies,
            )
        )
        self.coordinating_runtime = self.stage_runtime
        # Other stages' split layers run only in symbolic builds.
        self.stage_runtimes = [self.stage_runtime] * self.pipeline_parallel
        # `{stages: adapter}` over this rank's counterparts in the stages
        # sharing weights; every rank creates every group, in one order.
        adapters = self._shared_adapters = {}
        for stages, d, t in itertools.product(
            self.owners.shared_groups(),
            range(self.data_parallel),
            range(self.tensor_parallel),
        ):
            ranks = [self._rank_of(d, stage, t) for stage in stages]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                adapters[stages] = self._counted_adapter(group, "pipe")
        self.last_stage = self.pipeline_parallel - 1
        self.data_adapter = (
            self.stage_runtime.data_adapter if self.data_parallel > 1 else None
        )
        # The last training step's spans (`TorchStages.timeline`).
        self.timeline = []
        # `TorchStages` by micro-batch count and input shapes.
        self._pipelines = {}

    def _available_devices(self):
        return rank_devices()

    def _counted_adapter(self, group, axis):
        adapter = TorchCollectiveAdapter(group, axis)
        adapter.stats = self.stats
        return adapter

    @property
    def optimizer_runtime(self):
        # A `CoordinatedOptimizer` combines the replicas' gradients, or
        # takes the norms over the stage's shards where compile() made one.
        optimizer = getattr(self.trainer, "optimizer", None)
        coordinated = isinstance(unscaled(optimizer), CoordinatedOptimizer)
        if self.data_parallel > 1 or coordinated:
            return self.stage_runtime
        return None

    def _rank_of(self, data_index, stage_index, model_index):
        index = (data_index, stage_index, model_index)
        return int(np.ravel_multi_index(index, self.device_mesh.shape))

    def prepare_model(self, model):
        # Only this stage's seed generators hold their state here.
        self.stage_runtime.prepare_model(self.stage_model)

    def action_times(self):
        # Gathered from this replica's stages (a collective).
        records = [None] * self.pipeline_parallel
        dist.all_gather_object(records, self.timeline, group=self.pipe_group)
        times = {
            (stage, kind, m): (start, end)
            for stage, spans in enumerate(records)
            for kind, m, start, end in spans
        }
        return [times[tuple(action)] for action in self.trained_order]

    def build_optimizer(self, trainer):
        """Builds the optimizer's slots in one device's order (a checkpoint
        names them by position); a `CoordinatedOptimizer` this stage's."""
        held = self.stage_model if self.optimizer_runtime else trainer
        trainer.optimizer.build(held.trainable_variables)

    def _pipeline(self, x, with_loss=True):
        """This rank's `TorchStages` for this replica's inputs `x`."""
        leaves = keras.tree.flatten(x)
        count = self.microbatches(len(leaves[0]))
        shapes = tuple((tuple(t.shape), t.dtype) for t in leaves)
        key = (count, shapes, with_loss)
        if key not in self._pipelines:
            loss = self.loss_function(count) if with_loss else None
            self._pipelines[key] = TorchStages(self, count, loss)
        return self._pipelines[key]

    def data_row(self):
        return self.stage_runtime.data_row()

    def _sliced(self, data):
        """This replica's share of a global batch, as torch tensors."""
        data = keras.tree.map_structure(
            lambda t: t if t is None else keras.ops.convert_to_tensor(t), data
        )
        if self.data_adapter is not None and not self.batches_are_shares:
            slice_of = self.stage_runtime.batch_slice
            data = keras.tree.map_structure(slice_of, data)
        return data

    def train_step(self, data):
        x, targets = self.unpacked(self._sliced(data))
        pipeline = self._pipeline(x)
        variables = self.stage_model.trainable_variables
        for variable in variables:
            variable.value.grad = None
        loss, y_pred = pipeline.step(x, targets)
        self.timeline = pipeline.timeline
        self.trained_order = pipeline.order
        loss, scale = self._batch_loss(pipeline, loss, every_stage=True)
        if scale is not None:
            for variable in variables:
                if variable.value.grad is not None:
                    variable.value.grad *= scale
        # Every copy of a shared weight takes the sum of the gradients.
        adapters = self._shared_adapters
        with self.stats.labelled("optimizer"):
            for variable, gradient in self.owners.summed_shared(
                self.stage_index,
                lambda variable: grad_or_zeros(variable.value),
                lambda grad, stages: adapters[stages].all_reduce(grad),
            ):
                variable.value.grad = gradient
        # The CoordinatedOptimizer's mean over equal slices is the batch's.
        with torch.no_grad():
            self.trainer.optimizer.apply(
                [variable.value.grad for variable in variables], variables
            )
        return self._logs(x, targets, loss, y_pred)

    def test_step(self, data):
        x, targets = self.unpacked(self._sliced(data))
        pipeline = self._pipeline(x)
        loss, y_pred = pipeline.evaluate(x, targets)
        loss, _ = self._batch_loss(pipeline, loss, every_stage=False)
        return self._logs(x, targets, loss, y_pred)

    def _batch_loss(self, pipeline, loss, every_stage):
        """`(loss, scale)`: the last stage's `loss` times `scale`, the
        `fraction_scale` of every replica's micro-batches (`None` where
        the loss is not scaled; broadcast to the stages if `every_stage`),
        plus the stages' added losses."""
        scale = None
        split = pipeline.num_microbatches * self.data_parallel > 1
        if split and self.masked_predictions:
            scale = torch.zeros((), device=self.device)
            if self.stage_index == self.last_stage:
                fractions = torch.stack(pipeline.fractions)
                total = fractions.sum()
                if self.data_adapter is not None:
                    total = self.data_adapter.all_reduce(total)
                scale = fractions.numel() * self.data_parallel / total
            if every_stage:
                scale = self.pipe_adapter.broadcast(scale, self.last_stage)
            if loss is not None:
                loss = loss * scale
        if any(self.adding_stages):
            added = self.pipe_adapter.all_reduce(pipeline.added_loss())
            loss = None if loss is None else loss + added
        return loss, scale

    def predict_step(self, data):
        x = keras.utils.unpack_x_y_sample_weight(self._sliced(data))[0]
        y_pred = self._last_stage_outputs(x)
        if self.data_adapter is None:
            return y_pred
        # Every rank returns the whole batch's outputs.
        return self.stage_runtime.gathered(y_pred)

    def _logs(self, x, targets, loss, y_pred):
        """The step's logs on every rank, from each replica's last stage
        (its metrics summed over `data`)."""
        variables = self.trainer.metrics_variables
        if self.stage_index == self.last_stage:
            before = [v.value.detach().clone() for v in variables]
            with torch.no_grad():
                self.update_metrics(x, targets, loss, y_pred)
            if self.data_adapter is not None:
                self.stage_runtime.synchronise_step_state(variables, before)
        values = [v.value.detach().reshape(-1).double() for v in variables]
        # One broadcast for all of them: float64 holds float32 and int32
        # metric state exactly.
        buffer = self.pipe_adapter.broadcast(torch.cat(values), self.last_stage)
        parts = torch.split(buffer, [value.numel() for value in values])
        for variable, value in zip(variables, parts):
            variable.assign(value.reshape(variable.shape))
        return self.trainer.get_metrics_result()

    def _last_stage_outputs(self, x, training=False):
        """The stages' outputs of `x`, broadcast from the last stage."""
        outputs = self._pipeline(x, with_loss=False).predict(x, training)
        last = self.last_stage
        specs = [None]
        if self.stage_index == last:
            leaves = keras.tree.flatten(outputs)
            specs = [[(tuple(t.shape), t.dtype) for t in leaves]]
        dist.broadcast_object_list(specs, group=self.pipe_group, group_src=last)
        if self.stage_index != last:
            leaves = [
                torch.empty(shape, dtype=dtype, device=self.device)
                for shape, dtype in specs[0]
            ]
        leaves = [self.pipe_adapter.broadcast(t, last) for t in leaves]
        return keras.tree.pack_sequence_as(self.stage_models[-1].output, leaves)

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` on the stages (each replica on all of `x`);
        a symbolic one (Keras building its metrics) as a graph."""
        if is_symbolic(keras.tree.flatten(inputs)[0]):
            return super().call_model(model, inputs, training)
        inputs = keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)
        with self.stats.recording("call"):
            return self._last_stage_outputs(inputs, bool(training))


PIPELINE_RUNTIME = TorchPipelineRuntime
