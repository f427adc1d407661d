"""Pipeline stages on torch: `torch.distributed.pipelining` on Keras models.

Each rank runs one stage: a Keras model made of the user's own layers
(`keras_tp.pipeline.split_stages`), wrapped as the `nn.Module` that a
`PipelineStage` runs. torch's schedules (`ScheduleGPipe`,
`Schedule1F1B`) split the batch into micro-batches, send the activations
and their gradients between neighbouring ranks, and leave each stage's
gradients, averaged over the micro-batches, in its parameters' `.grad`.
The stage also times each micro-batch's forward and backward pass, and
counts the bytes it sends to its neighbours.
"""

import time

import keras
import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining import ScheduleGPipe

from keras_tp.collectives.base import nbytes
from keras_tp.pipeline import schedules

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
        return flatten_named(self.model(inputs, training=True))


def flatten_named(value):
    """A dict's values in the order of their keys; anything else as is."""
    if isinstance(value, dict):
        return tuple(value[name] for name in sorted(value))
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
            that averages over the micro-batch.
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
        self.stage = RecordedPipelineStage(
            KerasStageModule(stage_model),
            stats,
            stage_index,
            num_stages,
            device,
            group=group,
        )
        self.schedule = TORCH_SCHEDULES[schedule](
            self.stage,
            num_microbatches,
            loss_fn=lambda y_pred, y_true: loss(y_true, y_pred),
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
        schedules.check_microbatches(
            len(keras.tree.flatten(x)[0]), self.num_microbatches
        )
        self.stage.timeline = []
        losses = []
        if self.stage.is_first:
            inputs = flatten_named(x)
            self.schedule.step(
                *(inputs if isinstance(inputs, tuple) else [inputs])
            )
            return None, None
        if not self.is_last:
            self.schedule.step()
            return None, None
        outputs = self.schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean().detach(), outputs
