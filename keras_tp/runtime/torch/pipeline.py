"""Pipelines on torch: a rank's stage, its storage and its steps.

Each rank runs its tensor-parallel shard of one stage of one replica
(`TorchPipelineRuntime`), through the stage primitives of
`keras_tp.runtime.torch.stages` (`torch.distributed.pipelining` running
keras_tp's schedules), and stores its variables
(`keras_tp.runtime.torch.stage_storage`).
"""

import itertools

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.collectives.torch import TorchCollectiveAdapter
from keras_tp.collectives.torch import is_symbolic
from keras_tp.keras_internals import draw_from_state
from keras_tp.keras_internals import seed_generators
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.mesh import MeshRuntime
from keras_tp.runtime.torch import TorchRuntime
from keras_tp.runtime.torch.devices import join_process_group
from keras_tp.runtime.torch.devices import mesh_groups
from keras_tp.runtime.torch.devices import rank_devices
from keras_tp.runtime.torch.devices import this_device
from keras_tp.runtime.torch.stage_storage import StageStorage
from keras_tp.runtime.torch.stages import TorchPipeline
from keras_tp.tensors import nbytes


class TorchStageRuntime(TorchRuntime):
    """The tensor-parallel runtime of this rank's pipeline stage.

    A `TorchRuntime` on the ranks of one stage, a `data x model` mesh of
    its own inside the pipeline's `data x pipe x model` one: its `model`
    axis is this rank's tensor-parallel group `{(d, p, t')}` and its
    `data` axis the stage's replicas `{(d', p, t)}` (`groups`: those and
    both, see `TorchRuntime._axis_groups`). It places the stage's
    variables (this rank's shards), runs the stage's split layers over
    its group, and gathers their full values; the pipeline runs the
    steps.
    """

    def __init__(self, config, groups):
        self._groups = groups
        # The mesh's constructor, not TorchRuntime's: this process already
        # joined its process group, of which the stage holds a part.
        MeshRuntime.__init__(self, config)

    def _axis_groups(self):
        return self._groups


class TorchPipelineRuntime(StageStorage, PipelineRuntime):
    """Runs Keras' torch steps as pipelines, one stage shard per rank.

    `TensorParallelKeras(model, pipeline_parallel=P, data_parallel=D,
    world_size=D * P * T)`: D replicas of the pipeline, each training on
    its slice of every batch. The ranks form a `data x pipe x model` mesh,
    row-major: rank `d * P * T + p * T + t` runs the `t`-th
    tensor-parallel shard of stage `p` of replica `d`. Every rank builds
    the whole model (same seed), then keeps its own stage only, split by
    the model's plan over the stage's `T` ranks (`TorchStageRuntime`);
    the other stages' variables become "meta" tensors, which keep their
    shapes (Keras' symbolic builds read them) and hold no memory. A
    training step runs this rank's part of its replica's schedule
    (`TorchPipeline`) on the replica's slice of the batch, exchanging
    activations and their gradients (its own copy, or its shard of a split
    one, as Megatron-LM without its scatter-gather) with its counterparts
    `(d, p +/- 1, t)`; then it updates its own shard: with replicas, a
    `CoordinatedOptimizer` bound to the stage's runtime averages the
    gradients over them first (DDP's all-reduce, or ZeRO-1's
    reduce-scatter, update of this rank's partition and all-gather). The
    last stage of each replica, which has the loss and the outputs (whole
    on each of its ranks), updates the metrics; their updates are summed
    over the replicas, and the metric variables, and the outputs of a
    prediction, are then broadcast from it, so every rank logs and
    returns the same numbers.

    Attributes:
        timeline: this rank's `(kind, micro_batch, start, end)` spans of
            the last training step (see `RecordedPipelineStage`).
    """

    backend = "torch"
    # Each rank runs the code between split layers on its own tensors.
    local_ranks = True
    # Each stage that uses a weight holds a copy; their gradients are
    # summed over those stages (`_sum_shared_gradients`).
    shares_weights = True

    def __init__(self, model, config):
        needed = config.requested_world_size
        pipeline_parallel = config.pipeline_parallel
        data_parallel = config.data_parallel
        join_process_group(needed)
        ranks = dist.get_world_size()
        if needed != ranks:
            raise ValueError(
                f"world_size={needed} with pipeline_parallel="
                f"{pipeline_parallel} and data_parallel={data_parallel}, but "
                f"this process group has {ranks} rank(s): on torch each rank "
                "is one process, which runs its tensor-parallel shard of one "
                "stage of one replica (world_size = data_parallel x "
                "pipeline_parallel x the tensor-parallel ranks of each "
                "stage; without world_size, one rank per stage). Start "
                f"{needed} processes (keras_tp.launch(fn, world_size="
                f"{needed}) or torchrun --nproc-per-node {needed}) or pass "
                f"world_size={ranks}."
            )
        # This rank's number and torch device, as tensor parallelism
        # names them.
        self.rank = dist.get_rank()
        self.device = this_device()
        super().__init__(model, config)
        shape = {
            "data": data_parallel,
            "pipe": pipeline_parallel,
            "model": self.tensor_parallel,
        }
        self._mesh_shape = tuple(shape.values())
        self.data_index, self.stage_index, model_index = (
            int(i) for i in np.unravel_index(self.rank, self._mesh_shape)
        )
        model_group, self.pipe_group, data_group, stage_group = mesh_groups(
            shape, "model", "pipe", "data", ("data", "model")
        )
        self.stage_runtime = TorchStageRuntime(
            self.config.stage_config(self.stage_devices[self.stage_index]),
            (model_group, data_group, stage_group),
        )
        for adapter in (
            self.stage_runtime.adapter,
            self.stage_runtime.data_adapter,
            self.stage_runtime.world_adapter,
        ):
            adapter.stats = self.stats
        # Every stage's split layers run with this rank's stage runtime:
        # the rank computes its own stage only, and runs the others in
        # Keras' symbolic builds alone, on "meta" tensors, where no
        # collective runs and the shapes are those of its model rank.
        self.stage_runtimes = [self.stage_runtime] * pipeline_parallel
        self.stage_model = self.stage_models[self.stage_index]
        self._shared_adapters = self._shared_weight_adapters()
        # The rank (d, P - 1, t) of this replica and tensor-parallel rank:
        # the last stage, which has the loss, the metrics and the outputs.
        self.last_rank = self._rank_of(
            self.data_index, pipeline_parallel - 1, model_index
        )
        self.data_adapter = (
            self.stage_runtime.data_adapter if data_parallel > 1 else None
        )
        self.timeline = []
        # One `TorchPipeline` per micro-batch count and input shapes: a
        # torch stage fixes the shapes it sends and receives on its first
        # run.
        self._pipelines = {}

    def _shared_weight_adapters(self):
        """`{id(variable): adapter}` over the ranks whose stages hold a
        copy of a shared weight (a tied embedding), for this rank's
        stage's shared weights.

        Every rank creates every group, in the same order, as
        `torch.distributed.new_group` requires: one per set of stages
        sharing weights, replica and tensor-parallel rank. The copies'
        shards match, for every stage splits them alike.
        """
        adapters = {}
        for stages, d, t in itertools.product(
            sorted(set(map(tuple, self.shared_stages.values()))),
            range(self.data_parallel),
            range(self.tensor_parallel),
        ):
            ranks = [self._rank_of(d, stage, t) for stage in stages]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                adapters[stages] = TorchCollectiveAdapter(group, "pipe")
                adapters[stages].stats = self.stats
        # In the model's order, the same on every rank: each group's
        # ranks must all-reduce its weights in one order.
        return {
            id(variable): adapters[tuple(stages)]
            for variable in self.split.model.trainable_variables
            if self.stage_index
            in (stages := self.shared_stages.get(id(variable), ()))
        }

    def _available_devices(self):
        return rank_devices()

    def process_index(self):
        return self.rank

    def wait_for_processes(self):
        dist.barrier()

    @property
    def optimizer_runtime(self):
        """With replicas, the stage's runtime: a `CoordinatedOptimizer`
        over its `data` axis combines the replicas' gradients."""
        return self.stage_runtime if self.data_parallel > 1 else None

    def _rank_of(self, data_index, stage_index, model_index):
        """The global rank at these indices of the `data x pipe x model`
        mesh."""
        index = (data_index, stage_index, model_index)
        return int(np.ravel_multi_index(index, self._mesh_shape))

    def prepare_model(self, model):
        # As `TorchRuntime.prepare_model`: the ranks of a stage draw the
        # same masks, from the layers' seed generators. Only this stage's
        # generators hold their state here.
        draw_from_state(seed_generators(self.stage_model))

    @property
    def peak_activations(self):
        """The most micro-batches whose activations this rank's stage held
        at once in the last training step (each rank measures its own)."""
        in_flight = peak = 0
        for kind, *_ in self.timeline:
            in_flight += 1 if kind == "forward" else -1
            peak = max(peak, in_flight)
        return peak

    def measured_timeline(self):
        """The last training step's `schedules.Timeline`: every stage's
        spans, gathered from the ranks of this rank's pipeline (a
        collective: every rank calls it)."""
        records = [None] * self.pipeline_parallel
        dist.all_gather_object(records, self.timeline, group=self.pipe_group)
        if not all(records):
            return None
        return schedules.recorded_timeline(records)

    def build_optimizer(self, trainer):
        """Builds the optimizer's slots as one device does, in the same
        order on every rank (a checkpoint names them by position): those
        of other stages' variables are made on the meta device, without
        memory (`place_variable_like`). A `CoordinatedOptimizer` over the
        stage's replicas builds this stage's slots only."""
        held = self.stage_model if self.optimizer_runtime else trainer
        trainer.optimizer.build(held.trainable_variables)

    def _pipeline(self, x, with_loss=True):
        """This rank's `TorchPipeline` for this replica's inputs `x`: with
        the loss (training, evaluation) or without (prediction)."""
        leaves = keras.tree.flatten(x)
        count = self.microbatches(len(leaves[0]))
        shapes = tuple((tuple(t.shape), t.dtype) for t in leaves)
        key = (count, shapes, with_loss)
        if key not in self._pipelines:
            self._pipelines[key] = TorchPipeline(
                self.stage_model,
                self.stage_index,
                self.pipeline_parallel,
                count,
                self.schedule,
                self.loss_function() if with_loss else None,
                self.stats,
                self.device,
                group=self.pipe_group,
            )
        return self._pipelines[key]

    def _batch(self, data):
        """`(x, y, sample_weight)` of this replica's slice of a global
        batch, as torch tensors (`train_on_batch` passes NumPy arrays on);
        a `ValueError` if it does not split evenly over the replicas."""
        data = keras.tree.map_structure(
            lambda t: t if t is None else keras.ops.convert_to_tensor(t), data
        )
        if self.data_adapter is not None:
            slice_of = self.stage_runtime.batch_slice
            data = keras.tree.map_structure(slice_of, data)
        return keras.utils.unpack_x_y_sample_weight(data)

    def train_step(self, data):
        x, y, sample_weight = self._batch(data)
        self.check_no_sample_weight(sample_weight)
        pipeline = self._pipeline(x)
        variables = self.stage_model.trainable_variables
        for variable in variables:
            variable.value.grad = None
        loss, y_pred = pipeline.step(x, y)
        self.timeline = pipeline.stage.timeline
        self._sum_shared_gradients(variables)
        # Each replica's gradients are the mean over its slice of the
        # batch, and the slices are equal: the CoordinatedOptimizer's mean
        # over the replicas is the whole batch's.
        with torch.no_grad():
            self.trainer.optimizer.apply(
                [variable.value.grad for variable in variables], variables
            )
        return self._logs(pipeline, x, y, loss, y_pred)

    def _sum_shared_gradients(self, variables):
        """Sums each shared weight's gradients over the stages holding a
        copy, as Megatron-LM all-reduces the word embeddings' gradients
        between its first and last stages: every copy then takes the same
        update and stays equal. (`WeightOwners.gradient_addends` needs
        every stage's gradients in one process; a rank has its own.)"""
        held = {id(variable): variable for variable in variables}
        for key, adapter in self._shared_adapters.items():
            parameter = held[key].value
            gradient = parameter.grad
            if gradient is None:
                gradient = torch.zeros_like(parameter)
            with self.stats.labelled("optimizer"):
                parameter.grad = adapter.all_reduce(gradient)

    def test_step(self, data):
        x, y, sample_weight = self._batch(data)
        self.check_no_sample_weight(sample_weight)
        pipeline = self._pipeline(x)
        loss, y_pred = pipeline.forward(x, y)
        return self._logs(pipeline, x, y, loss, y_pred)

    def predict_step(self, data):
        y_pred = self._last_stage_outputs(self._batch(data)[0])
        if self.data_adapter is None:
            return y_pred
        # Every rank returns the whole batch's outputs: the replicas'
        # slices, in their order.
        return keras.tree.map_structure(
            lambda y: self.data_adapter.all_gather(y, 0), y_pred
        )

    def _logs(self, pipeline, x, y, loss, y_pred):
        """The step's logs, alike on every rank.

        The last stage of each replica adds its slice's loss and outputs to
        the metrics, and the replicas' updates are summed over `data`;
        every rank then takes its metric variables from its replica's last
        stage.
        """
        trainer = self.trainer
        variables = trainer.metrics_variables
        if pipeline.is_last:
            before = [v.value.detach().clone() for v in variables]
            update_loss_tracker(trainer, loss, len(keras.tree.flatten(x)[0]))
            with torch.no_grad():
                trainer.compute_metrics(x, y, y_pred, None)
            if self.data_adapter is not None:
                totals, _ = self.stage_runtime.synchronised_state(
                    [], [], before, [v.value.detach() for v in variables]
                )
                for variable, total in zip(variables, totals):
                    variable.assign(total)
        values = [v.value.detach().reshape(-1).double() for v in variables]
        # One broadcast for all of them: float64 holds float32 and int32
        # metric state exactly.
        buffer = torch.cat(values)
        dist.broadcast(buffer, src=self.last_rank, group=self.pipe_group)
        self.stats.record("broadcast", nbytes(buffer), "forward", "pipe")
        parts = torch.split(buffer, [value.numel() for value in values])
        for variable, value in zip(variables, parts):
            variable.assign(value.reshape(variable.shape))
        return trainer.get_metrics_result()

    def _last_stage_outputs(self, x, training=False):
        """The stages' outputs of `x`, without gradients, broadcast from
        the last stage to every rank of its replica."""
        _, outputs = self._pipeline(x, with_loss=False).forward(
            x, None, training
        )
        last = self.last_rank
        specs = [None]
        if self.rank == last:
            leaves = keras.tree.flatten(outputs)
            specs = [[(tuple(t.shape), t.dtype) for t in leaves]]
        dist.broadcast_object_list(specs, src=last, group=self.pipe_group)
        if self.rank != last:
            leaves = [
                torch.empty(shape, dtype=dtype, device=self.device)
                for shape, dtype in specs[0]
            ]
        for tensor in leaves:
            dist.broadcast(tensor, src=last, group=self.pipe_group)
            self.stats.record("broadcast", nbytes(tensor), "forward", "pipe")
        return keras.tree.pack_sequence_as(self.stage_models[-1].output, leaves)

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` runs the stages' forward passes on their
        ranks, without gradients (train with `fit()`); every rank returns
        the outputs.

        Each replica runs the whole call, so that inputs of any size work.
        A symbolic call (Keras building its metrics on "meta" tensors) runs
        the stages as a graph, as on one device.
        """
        if is_symbolic(keras.tree.flatten(inputs)[0]):
            return super().call_model(model, inputs, training)
        inputs = keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)
        with self.stats.recording("call"):
            return self._last_stage_outputs(inputs, bool(training))


PIPELINE_RUNTIME = TorchPipelineRuntime
