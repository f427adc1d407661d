"""The stage primitives of torch pipelines: `torch.distributed.pipelining`,
whose schedule runtime runs keras_tp's action lists over the ranks."""

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
    """A Keras stage model as the `nn.Module` of a `PipelineStage`, which
    passes tensors positionally: a stage's dicts of named tensors travel
    in the order of their names (`flatten_named`). The losses its layers
    add (`added_total` of `model.losses`) join its backward pass
    (`_AddedLoss`); `added` keeps each forward pass's total."""

    def __init__(self, model, added_total):
        super().__init__()
        self.model = model
        self.added_total = added_total
        self.added = []
        inputs = model.input
        self.input_names = sorted(inputs) if isinstance(inputs, dict) else None
        # The `training` argument of the stage's calls: forward-only
        # passes (evaluation, prediction) run with `False`.
        self.training_call = True
        # The bytes of the gradients a backward pass sends back: those of
        # the floating-point inputs.
        self.input_gradient_bytes = 0

    def forward(self, *tensors):
        self.input_gradient_bytes = sum(
            nbytes(t) for t in tensors if t.is_floating_point()
        )
        if self.input_names is not None:
            inputs = dict(zip(self.input_names, tensors))
        else:
            (inputs,) = tensors
        outputs = self.model(inputs, training=self.training_call)
        outputs = flatten_named(outputs)
        added = self.added_total(self.model.losses)
        if added is None:
            return outputs
        self.added.append(added.detach())
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        first = next(i for i, t in enumerate(flat) if t.is_floating_point())
        flat[first] = _AddedLoss.apply(flat[first], added)
        return tuple(flat) if isinstance(outputs, tuple) else flat[0]

    def structured(self, outputs):
        """The stage model's flat `outputs` in its own structure again."""
        if isinstance(self.model.output, dict):
            return dict(zip(sorted(self.model.output), outputs))
        return outputs


class _AddedLoss(torch.autograd.Function):
    """Passes a stage's output on unchanged and gives the losses its layers
    added a gradient of 1 in the stage's backward pass, as Megatron-LM's
    `MoEAuxLossAutoScaler` does; torch's schedule divides the stage's
    gradients by the micro-batch count, as the loss's."""

    @staticmethod
    def forward(ctx, output, added):
        ctx.save_for_backward(added)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (added,) = ctx.saved_tensors
        return grad_output, torch.ones_like(added)


def flatten_named(value):
    """A dict's values in the order of their keys; anything else as is."""
    if isinstance(value, dict):
        return tuple(value[name] for name in sorted(value))
    return value


class RecordedPipelineStage(PipelineStage):
    """A `PipelineStage` that counts its sends in `stats` and times each
    micro-batch: `timeline` holds `(kind, micro_batch, start, end)` of the
    last step, in `time.perf_counter()` seconds (one clock for every
    process of a Linux machine)."""

    def __init__(self, module, stats, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self.stats = stats
        self.timeline = []
        self.generators = seed_generators(module.model)

    def _forward_metadata_inference(self, *args, **kwargs):
        # torch runs a stage once to infer its shapes: that run must leave
        # the dropouts' random streams where they were.
        states = [g.state.value.clone() for g in self.generators]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for generator, state in zip(self.generators, states):
                generator.state.assign(state)

    def _to_tensor(self, arg):
        # The shape inference runs on uninitialised tensors: integer ones
        # (token ids a later stage looks up) start at 0.
        tensor = super()._to_tensor(arg)
        if isinstance(arg, torch.Tensor) or tensor.is_floating_point():
            return tensor
        return torch.zeros_like(tensor)

    def _timed(self, kind, run, chunk, *args, **kwargs):
        start = time.perf_counter()
        output = run(chunk, *args, **kwargs)
        self.timeline.append((kind, chunk, start, time.perf_counter()))
        return output

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        run = super().forward_one_chunk
        output = self._timed("forward", run, fwd_chunk_id, *args, **kwargs)
        if not self.is_last:
            for tensor in keras.tree.flatten(output):
                self.stats.record("send", nbytes(tensor), "forward", "pipe")
        return output

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        run = super().backward_one_chunk
        if not self.has_backward:
            # A forward-only run (`schedule.eval`) skips the backward pass.
            return run(bwd_chunk_id, *args, **kwargs)
        output = self._timed("backward", run, bwd_chunk_id, *args, **kwargs)
        if not self.is_first:
            bytes_sent = self.submod.input_gradient_bytes
            self.stats.record("send", bytes_sent, "backward", "pipe")
        return output


class TorchPipeline:
    """This rank's stage of a pipeline, run by torch's schedule runtime on
    keras_tp's action lists, which leaves the stage's gradients, averaged
    over the micro-batches, in `.grad`. Without a `loss` it only runs
    `forward` without targets."""

    def __init__(self, pipeline, num_microbatches, loss):
        # The stage of the `TorchPipelineRuntime` `pipeline`'s rank, which
        # is the stage's rank in `pipe_group`.
        stage_index = pipeline.stage_index
        module = KerasStageModule(
            pipeline.stage_model,
            lambda losses: pipeline.added_total(stage_index, losses),
        )
        self.num_microbatches = num_microbatches
        num_stages = pipeline.pipeline_parallel
        self.stage = RecordedPipelineStage(
            module,
            pipeline.stats,
            pipeline.stage_index,
            num_stages,
            pipeline.device,
            group=pipeline.pipe_group,
        )
        # The batch's targets while a step runs (`_run`), and each of its
        # micro-batches' `fraction` (`PipelineRuntime.loss_function`).
        self._targets = None
        self.fractions = []
        loss_fn = None
        if loss is not None:
            # torch's schedule splits one tensor of targets: the batch's row
            # indices, which pick each micro-batch's part of the targets
            # (any structure, with their sample weights).
            def loss_fn(y_pred, rows):
                targets = keras.tree.map_structure(
                    lambda t: t[rows], self._targets
                )
                value, fraction = loss(targets, module.structured(y_pred))
                self.fractions.append(fraction)
                return value

        self.schedule = _PipelineScheduleRuntime(
            [self.stage], num_microbatches, loss_fn=loss_fn
        )
        schedule = schedules.SCHEDULES[pipeline.schedule]
        actions = schedule(num_stages, num_microbatches)
        self.schedule._prepare_schedule_with_comms(
            {
                index: [
                    _Action(index, _COMPUTATIONS[a.kind], a.microbatch)
                    for a in stage_actions
                ]
                for index, stage_actions in enumerate(actions)
            }
        )

    def step(self, x, y):
        """Runs the forward and backward passes of one batch (`x` read by
        the first stage only, `y` by the last): on the last stage `(mean
        loss of the micro-batches, the batch's outputs)`, elsewhere
        `(None, None)`."""
        return self._run(self.schedule.step, x, y, training=True)

    def forward(self, x, y=None, training=False):
        """As `step`, the forward passes only, without gradients (and
        without loss without `y`), the stages called with `training`."""
        with torch.no_grad():
            return self._run(self.schedule.eval, x, y, training)

    def added_loss(self):
        """This stage's share of the losses its layers added in the last
        run: its micro-batches' totals averaged (torch's shape inference
        adds one before them on the first run); zero without any."""
        added = self.stage.submod.added[-self.num_microbatches :]
        if not added:
            return torch.zeros((), device=self.stage.device)
        return torch.stack(added).sum() / self.num_microbatches

    def _run(self, run, x, y, training):
        self.stage.timeline = []
        self.fractions = []
        self.stage.submod.added = []
        self.stage.submod.training_call = training
        inputs = ()
        if self.stage.is_first:
            inputs = flatten_named(x)
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not self.stage.is_last:
            run(*inputs)
            return None, None
        losses = rows = None
        if y is not None:
            self._targets = y
            batch = keras.tree.flatten(y)[0].shape[0]
            losses, rows = [], torch.arange(batch, device=self.stage.device)
        outputs = run(*inputs, target=rows, losses=losses)
        self._targets = None
        if losses:
            # torch computes a loss once on the first step's placeholder
            # outputs, to infer the shapes of the backward pass, before
            # the micro-batches' own.
            self.fractions = self.fractions[len(self.fractions) - len(losses) :]
        loss = None if y is None else torch.stack(losses).mean().detach()
        return loss, self.stage.submod.structured(outputs)
