"""The stage primitives of torch pipelines: `torch.distributed.pipelining`.

Each rank runs (its shard of) one stage: a Keras model made of the
user's own layers (`keras_tp.pipeline.split_stages`), wrapped as the
`nn.Module` that a `PipelineStage` runs (`KerasStageModule`). torch's
schedule runtime runs keras_tp's own action lists
(`keras_tp.pipeline.schedules`): it splits the batch into micro-batches,
sends the activations and their gradients between neighbouring ranks,
and leaves each stage's gradients, averaged over the micro-batches, in
its parameters' `.grad`. The stage also times each micro-batch's forward
and backward pass, and counts the bytes it sends to its neighbours
(`RecordedPipelineStage`).
"""

import time

import keras
import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action
from torch.distributed.pipelining.schedules import _ComputationType
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from keras_tp.keras_internals import seed_generators
from keras_tp.pipeline import schedules
from keras_tp.tensors import nbytes

# The computation of torch's schedule runtime that runs each kind of action.
_COMPUTATIONS = {
    schedules.FORWARD: _ComputationType.FORWARD,
    schedules.BACKWARD: _ComputationType.FULL_BACKWARD,
}


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
        loss_fn = (
            None
            if loss is None
            else lambda y_pred, y_true: loss(y_true, module.structured(y_pred))
        )
        actions = schedules.SCHEDULES[schedule](num_stages, num_microbatches)
        self.schedule = _schedule_runtime(
            self.stage, num_microbatches, loss_fn, actions
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


def _schedule_runtime(stage, num_microbatches, loss_fn, actions):
    """torch's schedule runtime, running keras_tp's `actions` on `stage`.

    `torch.distributed.pipelining` runs a schedule given as per-rank action
    lists (`_PipelineScheduleRuntime`) and adds the sends and receives
    between the stages, so GPipe and 1F1B come from
    `keras_tp.pipeline.schedules` on torch as on every backend.

    Args:
        stage: this rank's `PipelineStage`; stage `s` runs on rank `s` of
            the pipeline's group.
        num_microbatches: micro-batches per batch.
        loss_fn: the last stage's loss of `(y_pred, y_true)`, or `None`.
        actions: per stage, its `schedules.Action`s in order.
    """
    runtime = _PipelineScheduleRuntime(
        [stage], num_microbatches, loss_fn=loss_fn
    )
    runtime._prepare_schedule_with_comms(
        {
            index: [
                _Action(index, _COMPUTATIONS[a.kind], a.microbatch)
                for a in stage_actions
            ]
            for index, stage_actions in enumerate(actions)
        }
    )
    return runtime
