"""Pipeline stages on torch: `torch.distributed.pipelining` on Keras models.

Each rank runs (its shard of) one stage: a Keras model made of the
user's own layers (`keras_tp.pipeline.split_stages`), wrapped as the
`nn.Module` that a `PipelineStage` runs. torch's schedules
(`ScheduleGPipe`, `Schedule1F1B`) split the batch into micro-batches,
send the activations and their gradients between neighbouring ranks, and
leave each stage's gradients, averaged over the micro-batches, in its
parameters' `.grad`.
The stage also times each micro-batch's forward and backward pass, and
counts the bytes it sends to its neighbours.

`TorchPipelineRuntime` runs `TensorParallelKeras(model,
pipeline_parallel=P, data_parallel=D, world_size=D * P * T)`: D replicas
of the pipeline, each training on its slice of every batch, each stage
of a replica split over T ranks by tensor parallelism. The ranks form a
`data x pipe x model` mesh: rank `(d, p, t)` stores and computes the
`t`-th tensor-parallel shard of stage `p` of replica `d` only, and the
steps of Keras' torch trainer run as this rank's part of its replica's
schedule. As in Megatron (without its scatter-gather of the boundary
activations), each rank exchanges its own copy of the activations, or
its shard of a split one, with its counterparts `(d, p +/- 1, t)`.
"""

import gc
import time

import keras
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining import ScheduleGPipe

from keras_tp.collectives.base import nbytes
from keras_tp.collectives.torch import TorchCollectiveAdapter
from keras_tp.collectives.torch import is_symbolic
from keras_tp.keras_internals import draw_from_state
from keras_tp.keras_internals import own_optimizer_variables
from keras_tp.keras_internals import seed_generators
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.pipeline.runtime import one_device_keys
from keras_tp.pipeline.runtime import stage_slots
from keras_tp.runtime.base import Runtime
from keras_tp.runtime.torch import TorchRuntime
from keras_tp.runtime.torch.process_group import join_process_group
from keras_tp.runtime.torch.process_group import mesh_groups
from keras_tp.runtime.torch.storage import parameter_of
from keras_tp.runtime.torch.storage import swap_storage
from keras_tp.runtime.torch.storage import to_numpy
from keras_tp.runtime.torch.storage import write_on_rank_zero

# torch.distributed.pipelining's own schedule of each name.
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class KerasStageModule(torch.nn.Module):
    """A Keras stage model as the `nn.Module` of a `PipelineStage`.

    A `PipelineStage` passes each tensor it receives as a positional
    argument and sends each tensor the module returns. A stage model of
    `keras_tp.pipeline.split_stages` takes and returns dicts of named
    tensors, which travel in the order of their names
    (`flatten_named`). Keras layers on torch are `nn.Module`s, so the
    stage's parameters are this module's.

    Args:
        model: the stage's Keras model.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        inputs = model.input
        self.input_names = sorted(inputs) if isinstance(inputs, dict) else None
        # The `training` argument of the stage's calls: forward-only
        # passes (evaluation, prediction) run with `False`.
        self.training_call = True
        # The bytes of the gradients a backward pass of this stage sends
        # back: one per floating-point input (integer inputs, such as a
        # carried padding mask, have none).
        self.input_gradient_bytes = 0

    def forward(self, *tensors):
        self.input_gradient_bytes = sum(
            nbytes(t) for t in tensors if t.is_floating_point()
        )
        if self.input_names is not None:
            inputs = dict(zip(self.input_names, tensors))
        else:
            (inputs,) = tensors
        return flatten_named(self.model(inputs, training=self.training_call))

    def structured(self, outputs):
        """The stage model's outputs in its own structure again.

        Args:
            outputs: what `forward` returned (or the schedule merged).
        """
        return unflatten_named(outputs, self.model.output)


def flatten_named(value):
    """A dict's values in the order of their keys; anything else as is."""
    if isinstance(value, dict):
        return tuple(value[name] for name in sorted(value))
    return value


def unflatten_named(value, structure):
    """The inverse of `flatten_named` for a value shaped like `structure`."""
    if isinstance(structure, dict):
        return dict(zip(sorted(structure), value))
    return value


class RecordedPipelineStage(PipelineStage):
    """A `PipelineStage` that times each micro-batch and counts its sends.

    `timeline` holds `(kind, micro_batch, start, end)` of the last step,
    in `time.perf_counter()` seconds, which on Linux is one clock for
    every process of the machine. Each micro-batch's activations sent
    forward and gradients sent back are recorded in `stats` on the axis
    `"pipe"`.

    Args:
        module: the stage's `KerasStageModule`.
        stats: the `CommunicationStats` to record in.
        *args, **kwargs: the rest of `PipelineStage`'s arguments.
    """

    def __init__(self, module, stats, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.stats = stats
        self.timeline = []
        self.generators = seed_generators(module.model)

    def _forward_metadata_inference(self, *args, **kwargs):
        # torch infers a stage's shapes by running it once before its
        # first step. One device draws no dropout mask there, and a run
        # resumed from a checkpoint makes its pipeline again: the draw
        # must leave the dropouts' random streams where they were.
        states = [g.state.value.clone() for g in self.generators]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for generator, state in zip(self.generators, states):
                generator.state.assign(state)

    def _to_tensor(self, arg):
        # torch infers a stage's shapes by running it once on tensors made
        # from the metadata it receives, left uninitialised; a stage that
        # looks up received token ids (a seq2seq decoder's embedding, in a
        # later stage) would index with garbage. Integer ones start at 0.
        tensor = super()._to_tensor(arg)
        if isinstance(arg, torch.Tensor) or tensor.is_floating_point():
            return tensor
        return torch.zeros_like(tensor)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        start = time.perf_counter()
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self.timeline.append(
            ("forward", fwd_chunk_id, start, time.perf_counter())
        )
        if not self.is_last:
            for tensor in keras.tree.flatten(output):
                self.stats.record("send", nbytes(tensor), "forward", "pipe")
        return output

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        if not self.has_backward:
            # A forward-only run (`schedule.eval`) skips the backward pass.
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        start = time.perf_counter()
        output = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        self.timeline.append(
            ("backward", bwd_chunk_id, start, time.perf_counter())
        )
        if not self.is_first:
            self.stats.record(
                "send", self.submod.input_gradient_bytes, "backward", "pipe"
            )
        return output


class TorchPipeline:
    """This rank's stage of a pipeline, and the schedule that runs it.

    Args:
        stage_model: the Keras model of this rank's stage.
        stage_index: the stage's place in the pipeline.
        num_stages: the number of stages (ranks of `group`).
        num_microbatches: micro-batches per batch.
        schedule: `"gpipe"` or `"1f1b"`.
        loss: the last stage's loss, a function of `(y_true, y_pred)`
            that averages over the micro-batch; `None` for a pipeline
            that only runs `forward` without targets (torch's schedules
            compute the loss whenever they have one).
        stats: the `CommunicationStats` that count the point-to-point
            traffic (axis `"pipe"`).
        device: this rank's torch device.
        group: the process group of the pipeline's ranks.
    """

    def __init__(
        self,
        stage_model,
        stage_index,
        num_stages,
        num_microbatches,
        schedule,
        loss,
        stats,
        device,
        group=None,
    ):
        schedules.check_schedule_name(schedule)
        module = KerasStageModule(stage_model)
        self.stage = RecordedPipelineStage(
            module, stats, stage_index, num_stages, device, group=group
        )
        self.schedule = TORCH_SCHEDULES[schedule](
            self.stage,
            num_microbatches,
            loss_fn=None
            if loss is None
            else lambda y_pred, y_true: loss(y_true, module.structured(y_pred)),
        )
        self.num_microbatches = num_microbatches

    @property
    def is_last(self):
        return self.stage.is_last

    def step(self, x, y):
        """Runs the forward and backward passes of one batch.

        Args:
            x: the batch's inputs; read by the first stage only.
            y: the batch's targets; read by the last stage only.

        Returns:
            On the last stage, `(mean loss of the micro-batches, the
            batch's outputs)`; elsewhere `(None, None)`.
        """
        return self._run(self.schedule.step, x, y, training=True)

    def forward(self, x, y=None, training=False):
        """Runs the forward passes of one batch only, without gradients.

        Args:
            x: the batch's inputs; read by the first stage only.
            y: the batch's targets, or `None` for no loss; read by the
                last stage only.
            training: the `training` argument of the stages' calls.

        Returns:
            On the last stage, `(mean loss of the micro-batches or None,
            the batch's outputs)`; elsewhere `(None, None)`.
        """
        with torch.no_grad():
            return self._run(self.schedule.eval, x, y, training)

    def _run(self, run, x, y, training):
        """Runs the schedule's `run` (`step` or `eval`) on this stage."""
        schedules.check_microbatches(
            len(keras.tree.flatten(x)[0]), self.num_microbatches
        )
        self.stage.timeline = []
        self.stage.submod.training_call = training
        inputs = ()
        if self.stage.is_first:
            inputs = flatten_named(x)
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not self.is_last:
            run(*inputs)
            return None, None
        losses = None if y is None else []
        outputs = run(*inputs, target=y, losses=losses)
        loss = None if y is None else torch.stack(losses).mean().detach()
        return loss, self.stage.submod.structured(outputs)


class TorchStageRuntime(TorchRuntime):
    """The tensor-parallel runtime of this rank's pipeline stage.

    A `TorchRuntime` on the ranks of one stage, a `data x model` mesh of
    its own inside the pipeline's `data x pipe x model` one: its `model`
    axis is this rank's tensor-parallel group `{(d, p, t')}` and its
    `data` axis the stage's replicas `{(d', p, t)}`. It places the stage's
    variables (this rank's shards), runs the stage's split layers over
    its group, and gathers their full values; the pipeline runs the
    steps.

    Args:
        config: the `keras_tp.ParallelConfig` of the stage's ranks (see
            `ParallelConfig.stage_config`).
        groups: this rank's process groups of the stage's `model` axis,
            its `data` axis and both (see `TorchRuntime._axis_groups`).
    """

    def __init__(self, config, groups):
        self._groups = groups
        # Runtime's constructor, not TorchRuntime's: this process already
        # joined its process group, of which the stage holds a part.
        Runtime.__init__(self, config)

    def _axis_groups(self):
        return self._groups


class TorchPipelineRuntime(PipelineRuntime):
    """Runs Keras' torch steps as pipelines, one stage shard per rank.

    The ranks form a `data x pipe x model` mesh, row-major: rank
    `d * P * T + p * T + t` runs the `t`-th tensor-parallel shard of
    stage `p` of replica `d`. Every rank builds the whole model (same
    seed), then keeps its own stage only, split by the model's
    tensor-parallel plan over the stage's `T` ranks (`TorchStageRuntime`).
    The other stages' variables become "meta" tensors, which keep their
    shapes (Keras' symbolic builds read them) and hold no memory. A
    training step runs this rank's part of its replica's schedule
    (`TorchPipeline`) on the replica's slice of the batch, exchanging
    activations and their gradients with the ranks of the same replica
    and tensor-parallel rank in the neighbouring stages, averages the
    stage's gradients over the replicas and updates its own shard: with
    replicas, a `CoordinatedOptimizer` bound to the stage's runtime does
    both (DDP's all-reduce, or ZeRO-1's reduce-scatter, update of this
    rank's partition of the optimizer state and all-gather). The last
    stage of each replica, which has the loss and the outputs (whole on
    each of its ranks), updates the metrics; their updates are summed
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
    # The stage's optimizer step sees the gradients summed over every
    # micro-batch, so ZeRO-1 reduce-scatters once per step.
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
        TorchRuntime._build(self)
        super().__init__(model, config)
        shape = {
            "data": data_parallel,
            "pipe": pipeline_parallel,
            "model": self.tensor_parallel,
        }
        self.data_index, self.stage_index, model_index = (
            int(i) for i in np.unravel_index(self.rank, tuple(shape.values()))
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
        if self.tensor_parallel > 1:
            for stage_model in self.stage_models[1:]:
                _accept_split_inputs(stage_model)
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
        for stages in sorted(set(map(tuple, self.shared_stages.values()))):
            for data_index in range(self.data_parallel):
                for tensor_index in range(self.tensor_parallel):
                    ranks = [
                        self._rank_of(data_index, stage, tensor_index)
                        for stage in stages
                    ]
                    group = dist.new_group(ranks)
                    if self.rank not in ranks:
                        continue
                    adapter = TorchCollectiveAdapter(group, "pipe")
                    adapter.stats = self.stats
                    adapters[stages] = adapter
        # In the model's order, the same on every rank: each group's
        # ranks must all-reduce its weights in one order.
        return {
            id(variable): adapters[tuple(stages)]
            for variable in self.split.model.trainable_variables
            if self.stage_index
            in (stages := self.shared_stages.get(id(variable), ()))
        }

    def _holds(self, variable):
        """Whether this rank's stage uses (and so holds) `variable`."""
        stages = self.shared_stages.get(
            id(variable), [self.stage_of[id(variable)]]
        )
        return self.stage_index in stages

    synchronised_state = Runtime.synchronised_state
    _batch_slice = TorchRuntime._batch_slice
    process_index = TorchRuntime.process_index
    wait_for_processes = TorchRuntime.wait_for_processes

    def full_shape(self, variable):
        """The unsplit shape of `variable`: as this rank's stage placed
        it (a ZeRO partition's slot), or as the model was placed."""
        if self.stage_runtime.placement.is_placed(variable):
            return self.stage_runtime.full_shape(variable)
        return super().full_shape(variable)

    def local_pieces(self, variable):
        """This rank's pieces of its stage's variables. A weight several
        stages share, and its slots, are written by the first of them;
        the optimizer's own variables (its iteration count), alike on
        every rank, by the first rank."""
        if isinstance(variable, SlotOfAnotherStage):
            return []
        stage = self.stage_of.get(id(variable))
        reference = self.stage_runtime.placement.references.get(id(variable))
        if stage is None and reference is not None:
            stage = self.stage_of.get(id(reference))
        if stage is None:
            stage = 0
        if stage != self.stage_index:
            return []
        return self.stage_runtime.local_pieces(variable)

    def assign_local_pieces(self, variable, read):
        """Assigns this rank's pieces of every variable it holds: its
        stage's, a shared weight's copy, the optimizer's own."""
        if isinstance(variable, SlotOfAnotherStage):
            return
        if id(variable) not in self.stage_of or self._holds(variable):
            self.stage_runtime.assign_local_pieces(variable, read)

    def checkpoint_optimizer_state(self, optimizer):
        """With replicas, the state of this rank's `CoordinatedOptimizer`,
        built on its stage's variables, keyed as one device's optimizer
        keys its own (`one_device_keys`). Every rank lists every key, as
        the checkpoint code expects: the ranks of a pipeline tell each
        other their slots (a collective: every rank calls it), and the
        slots of other stages stand as `SlotOfAnotherStage`s. Without
        replicas the optimizer is built in one device's order
        (`build_optimizer`), and keyed so."""
        if self.optimizer_runtime is None:
            return None
        inner = optimizer.inner_optimizer
        references = self.stage_runtime.placement.references
        slots = stage_slots(inner, references)
        trainable = self.trainer.trainable_variables
        owned = {
            position: [
                (slot.path, self.full_shape(slot), slot.dtype)
                for slot in slots[id(variable)]
            ]
            for position, variable in enumerate(trainable)
            if self.stage_of[id(variable)] == self.stage_index
            and id(variable) in slots
        }
        stages = [None] * self.pipeline_parallel
        dist.all_gather_object(stages, owned, group=self.pipe_group)
        described = {p: d for stage in stages for p, d in stage.items()}
        for position, variable in enumerate(trainable):
            if id(variable) not in slots and position in described:
                slots[id(variable)] = [
                    SlotOfAnotherStage(*description)
                    for description in described[position]
                ]
        own = [v for v in inner.variables if id(v) not in references]
        counts = {p: len(d) for p, d in described.items()}
        state = one_device_keys(trainable, own, slots, counts)
        wrapper = own_optimizer_variables(optimizer)
        return state + [(f"coordinated/{i}", v) for i, v in enumerate(wrapper)]

    def _available_devices(self):
        return TorchRuntime._available_devices(self)

    @property
    def optimizer_runtime(self):
        """With replicas, the stage's runtime: a `CoordinatedOptimizer`
        over its `data` axis combines the replicas' gradients."""
        return self.stage_runtime if self.data_parallel > 1 else None

    def _rank_of(self, data_index, stage_index, model_index):
        """The global rank at `(data_index, stage_index, model_index)` of
        the `data x pipe x model` mesh."""
        return (
            data_index * self.pipeline_parallel + stage_index
        ) * self.tensor_parallel + model_index

    def prepare_model(self, model):
        # As `TorchRuntime.prepare_model`: the ranks of a stage draw the
        # same masks, from the layers' seed generators. Only this stage's
        # generators hold their state here.
        draw_from_state(seed_generators(self.stage_model))

    def place_variable(self, variable, axis):
        """Keeps this rank's shard of its own stage's variables; the other
        stages' variables keep the shape of their shard on the meta
        device, without memory."""
        # The planner's trace of the model, just made, leaves dead autograd
        # graphs that still hold the variables; they are young, and
        # collecting the young generations frees them in a fraction of the
        # full collection `swap_storage` falls back to.
        gc.collect(1)
        if self._holds(variable):
            self.stage_runtime.placement.place(variable, axis)
        else:
            _to_meta(variable, self.placement.model_shard_shape(variable))

    def place_variable_like(self, variable, reference, data_axis):
        """Places an optimizer slot with its reference: Keras makes it in
        the reference's shape on this rank's device, its shard already."""
        self.stage_of[id(variable)] = self.stage_of[id(reference)]
        if id(reference) in self.shared_stages:
            self.shared_stages[id(variable)] = self.shared_stages[id(reference)]
        if self._holds(reference):
            self.stage_runtime.placement.place_like(variable, reference)
        else:
            _to_meta(variable, tuple(variable.shape))

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
        if self.optimizer_runtime is None:
            trainer.optimizer.build(trainer.trainable_variables)
        else:
            trainer.optimizer.build(self.stage_model.trainable_variables)

    def _pipeline(self, x, with_loss=True):
        """This rank's `TorchPipeline` for a batch of inputs `x`.

        Args:
            x: this replica's part of the batch's inputs.
            with_loss: whether it computes the loss (training and
                evaluation) or only the outputs (prediction).
        """
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

    def _replica_part(self, data):
        """This replica's slice of every tensor of a global batch, as
        torch tensors (`train_on_batch` passes NumPy arrays on).

        Raises:
            ValueError: if the batch does not split evenly over the
                replicas.
        """
        data = keras.tree.map_structure(
            lambda t: t if t is None else keras.ops.convert_to_tensor(t), data
        )
        if self.data_adapter is None:
            return data
        return keras.tree.map_structure(self._batch_slice, data)

    def train_step(self, data):
        data = self._replica_part(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
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
        update and stays equal."""
        held = {id(variable): variable for variable in variables}
        for key, adapter in self._shared_adapters.items():
            parameter = held[key].value
            gradient = parameter.grad
            if gradient is None:
                gradient = torch.zeros_like(parameter)
            with self.stats.labelled("optimizer"):
                parameter.grad = adapter.all_reduce(gradient)

    def test_step(self, data):
        data = self._replica_part(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        pipeline = self._pipeline(x)
        loss, y_pred = pipeline.forward(x, y)
        return self._logs(pipeline, x, y, loss, y_pred)

    def predict_step(self, data):
        data = self._replica_part(data)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        _, y_pred = self._pipeline(x, with_loss=False).forward(x)
        y_pred = self._from_last_stage(y_pred)
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
                totals, _ = self.synchronised_state(
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

    def _from_last_stage(self, outputs):
        """The last stage's `outputs`, broadcast to every rank of its
        replica."""
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
            _, outputs = self._pipeline(inputs, with_loss=False).forward(
                inputs, training=bool(training)
            )
            return self._from_last_stage(outputs)

    def full_value(self, variable):
        """The variable's unsplit value, assembled by its stage's ranks in
        the first replica and broadcast from the first of them."""
        full = self._assembled(variable)
        if full is None:
            full = self._empty_full(variable)
        dist.broadcast(full, src=self._assembler(variable))
        return to_numpy(full)

    def _assembler(self, variable):
        """The rank that assembles `variable`: `(0, its stage, 0)`."""
        return self._rank_of(0, self.stage_of[id(variable)], 0)

    def _assembled(self, variable):
        """The unsplit value of `variable` on its stage's ranks in the
        first replica, `None` on the other ranks.

        Those ranks gather the shards of a split variable over their
        model group (every rank of the group takes part).
        """
        if self.data_index or self.stage_of[id(variable)] != self.stage_index:
            return None
        full = self.stage_runtime._unsplit(
            variable, parameter_of(variable).detach()
        )
        # A copy: the array returned must not change with training.
        return full.clone()

    def _empty_full(self, variable):
        """An uninitialised tensor of `variable`'s unsplit shape."""
        return torch.empty(
            self.placement.full_shapes[id(variable)],
            dtype=parameter_of(variable).dtype,
            device=self.device,
        )

    def assign_full_value(self, variable, value):
        """Assigns this rank's part of `value` on the ranks of the
        variable's stage, its shard on each tensor-parallel rank.

        Every rank passes the same `value`, as in any SPMD program.
        """
        if self._holds(variable):
            self.stage_runtime.assign_full_value(variable, value)

    def save_model(self, model, filepath, **kwargs):
        """Rank 0 writes the unsplit model; each variable's stage in the
        first replica assembles it and sends it to rank 0, which holds it
        only while writing.

        Every rank returns once the file is written, and raises if rank 0
        failed to write it.
        """

        def gathered():
            for variable in model.variables:
                assembler = self._assembler(variable)
                split = self.placement.split_axis(variable) is not None
                if assembler == 0 and not split:
                    # Rank 0 holds it whole.
                    continue
                full = self._assembled(variable)
                if assembler != 0:
                    if self.rank == assembler:
                        dist.send(full, dst=0)
                    elif self.rank == 0:
                        full = self._empty_full(variable)
                        dist.recv(full, src=assembler)
                if self.rank == 0:
                    yield variable, full

        write_on_rank_zero(
            self.rank, gathered(), lambda: model.save(filepath, **kwargs)
        )

    def device_bytes(self, variables):
        """`{this rank's device: bytes}` of its tensors, each storage once.

        The other stages' variables, meta tensors here, hold no memory.
        """
        own = [v for v in variables if parameter_of(v).device.type != "meta"]
        return TorchRuntime.device_bytes(self, own)


class SlotOfAnotherStage:
    """What a checkpoint lists of an optimizer slot another stage's rank
    holds: its path, unsplit shape and dtype. This rank writes and reads
    none of it.

    Args:
        path: the slot's path.
        shape: its unsplit shape.
        dtype: its dtype.
    """

    def __init__(self, path, shape, dtype):
        self.path = path
        self.shape = tuple(shape)
        self.dtype = dtype


def _accept_split_inputs(stage_model):
    """Lets a stage model take the tensors that cross its cut split.

    Keras checks a Functional model's inputs against the shapes of its
    `Input`s, which are the unsplit ones; a tensor that a stage leaves
    split by tensor parallelism (a Column layer's output) arrives as this
    rank's shard. Only the ranks of the inputs are checked here: the
    split layers that consume such a tensor check its width themselves
    (`ShardedRegion.check_input_widths`).
    """
    specs = stage_model.input_spec
    if specs is None:
        return
    stage_model.input_spec = [
        keras.InputSpec(
            ndim=len(spec.shape),
            allow_last_axis_squeeze=spec.allow_last_axis_squeeze,
            name=spec.name,
            optional=spec.optional,
        )
        for spec in specs
    ]


def _to_meta(variable, shape):
    """Makes `variable` a "meta" tensor of `shape`: a variable of another
    stage, which no rank of this stage computes, keeps the shape of its
    shard for Keras' symbolic builds and holds no memory."""
    parameter = parameter_of(variable)
    swap_storage(
        variable, torch.empty(shape, dtype=parameter.dtype, device="meta")
    )


PIPELINE_RUNTIME = TorchPipelineRuntime
