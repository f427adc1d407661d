"""The stage primitives of torch pipelines: each rank runs its stage's
actions through the shared executor and exchanges activations and their
gradients with its neighbours by point-to-point operations."""

import time

import keras
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard

from keras_tp.pipeline import schedules
from keras_tp.pipeline.executor import StagePrimitives
from keras_tp.pipeline.executor import run_forward
from keras_tp.pipeline.executor import run_schedule
from keras_tp.tensors import carried_masks
from keras_tp.tensors import concatenated
from keras_tp.tensors import floats_of
from keras_tp.tensors import nbytes


class TorchStages(StagePrimitives):
    """The stage of a `TorchPipelineRuntime`'s rank. A training step leaves
    its gradients in `.grad`, each micro-batch's losses weighing
    `1 / num_microbatches`; `timeline` holds `(kind, micro_batch, start,
    end)` of each pass of the last run, in `time.perf_counter()` seconds
    (one clock for a machine's processes). `loss` is `loss_function`'s,
    `None` for `predict` only."""

    def __init__(self, pipeline, num_microbatches, loss):
        super().__init__(pipeline, num_microbatches)
        self.stage = pipeline.stage_index
        self.model = pipeline.stage_model
        self.loss = loss
        self.stage_order = [a for a in self.order if a.stage == self.stage]
        # Each received tensor's `(shape, dtype, shard axis)`, told once.
        self._received_specs = None
        self._told_specs = False

    def step(self, x, y):
        """The passes of one batch: `(loss, outputs)` on the last stage,
        elsewhere `(None, None)`."""
        return self._run(run_schedule, True, self.stage_order, x, y)

    def evaluate(self, x, y):
        """As `step`, the forward passes only, without gradients."""
        forwards = [a for a in self.stage_order if a.kind == schedules.FORWARD]
        with torch.no_grad():
            return self._run(run_schedule, False, forwards, x, y)

    def predict(self, x, training=False):
        """The last stage's outputs of `x` (`None` on the other stages)."""
        with torch.no_grad():
            return self._run(run_forward, training, x)

    def added_loss(self):
        """This stage's micro-batches' added losses, averaged (or zero)."""
        if not self._added:
            return torch.zeros((), device=self.pipeline.device)
        return torch.stack(self._added).sum() / self.num_microbatches

    def _run(self, run, training, *args):
        self.timeline, self.fractions, self._added = [], [], []
        # Per micro-batch, the received tensors that take gradients; and
        # those, the outputs whose gradients come back and the roots
        # seeded with 1 (loss, added loss).
        self._received, self._held, self._sending = {}, {}, []
        self.training = training
        try:
            # Backward passes too: they read what the forward passes saved.
            runtime = self.pipeline.stage_runtime
            with runtime.step_context(), runtime.accumulating_gradients():
                return run(self, *args)
        finally:
            # A send's tensor lives until its receiver has it.
            for work in self._sending:
                work.wait()
            self._sending = []

    def forward(self, stage, m, inputs, target):
        start = time.perf_counter()
        received = self._received.pop(m, [])
        outputs = self._call(inputs)
        added = self.pipeline.added_total(stage, self.model.losses)
        ones = []
        if added is not None:
            self._added.append(added.detach())
            ones.append(added / self.num_microbatches)
        detached = keras.tree.map_structure(torch.Tensor.detach, outputs)
        if target is None:
            # The next stage sends back the gradients of the floats.
            held, result = floats_of(outputs), (detached, None)
        else:
            value, fraction = self.loss(target, outputs)
            self.fractions.append(fraction)
            ones.append(value)
            held, result = [], ((value.detach(), fraction), detached)
        if torch.is_grad_enabled():
            self._held[m] = (received, held, ones)
        self.timeline.append(("forward", m, start, time.perf_counter()))
        return result

    def backward(self, stage, m, cotangent):
        start = time.perf_counter()
        received, outputs, ones = self._held.pop(m)
        roots = [*outputs, *ones]
        # A sequence shard's gradient came as its rank's part.
        cotangent = [_like(o, g) for o, g in zip(outputs, cotangent or ())]
        seed = self.pipeline.loss_seed()
        seeds = [seed.to(one.device, one.dtype).expand_as(one) for one in ones]
        grads = [*cotangent, *seeds]
        pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
        if pairs:
            torch.autograd.backward(*zip(*pairs))
        # Under sequence parallelism a gradient may be a shard.
        sent = self.pipeline.stage_runtime.whole_outputs(
            [grad_or_zeros(t) for t in received]
        )
        self.timeline.append(("backward", m, start, time.perf_counter()))
        return sent

    def infer(self, stage, inputs):
        if stage != self.stage:
            return None
        outputs = self._call(inputs)
        if stage == self.num_stages - 1:
            return outputs, carried_masks(outputs)
        return outputs

    def _call(self, inputs):
        """The stage's outputs of `inputs`, whole but the sequence shards
        of a stage before the last (sent so, as Megatron-LM sends them)."""
        outputs = self.model(inputs, training=self.training)
        self.pipeline.stage_runtime.whole_losses(self.model)
        whole = self.pipeline.stage_runtime.whole_outputs
        if self.stage == self.num_stages - 1:
            return whole(outputs)
        return keras.tree.map_structure(
            lambda t: t if _shard_axis(t) is not None else whole(t), outputs
        )

    def joined(self, losses, predictions):
        if self.stage != self.num_stages - 1:
            return None, None
        loss = sum(share for share, _ in losses) if losses else None
        return loss, concatenated(predictions)

    def send(self, value, stage, direction):
        if value is None:
            return None
        leaves = keras.tree.flatten(value)
        tensors = [_local(t).detach().contiguous() for t in leaves]
        # The ranks of `pipe_group` are the stages, in order.
        group = self.pipeline.pipe_group
        if direction == schedules.FORWARD and not self._told_specs:
            specs = [
                (tuple(t.shape), t.dtype, _shard_axis(leaf))
                for t, leaf in zip(tensors, leaves)
            ]
            dist.send_object_list([specs], group=group, group_dst=stage)
            self._told_specs = True
        for tensor in tensors:
            self.stats.record("send", nbytes(tensor), direction, "pipe")
            work = dist.isend(tensor, group=group, group_dst=stage)
            self._sending.append(work)
        return None

    def receive(self, stage, m, direction):
        forward = direction == schedules.FORWARD
        sender = stage - 1 if forward else stage + 1
        if stage != self.stage or not 0 <= sender < self.num_stages:
            return None
        group = self.pipeline.pipe_group
        if forward and self._received_specs is None:
            told = [None]
            dist.recv_object_list(told, group=group, group_src=sender)
            self._received_specs = told[0]
        specs = self._received_specs
        if not forward:
            specs = [(_local(t).shape, t.dtype, None) for t in self._held[m][1]]
        device = self.pipeline.device
        tensors = [torch.empty(s, dtype=d, device=device) for s, d, _ in specs]
        for tensor in tensors:
            dist.recv(tensor, group=group, group_src=sender)
        if not forward:
            return tensors
        # The floats take gradients; a sequence shard is one again.
        self._received[m] = [t.requires_grad_() for t in floats_of(tensors)]
        tensors = [
            t if axis is None else self._sequence_shard(t, axis)
            for t, (_, _, axis) in zip(tensors, specs)
        ]
        return keras.tree.pack_sequence_as(self.model.input, tensors)

    def _sequence_shard(self, local, axis):
        """`local` as a `DTensor` split on `axis` over the stage's ranks."""
        mesh = self.pipeline.stage_runtime.adapter.inner.device_mesh
        return DTensor.from_local(local, mesh, [Shard(axis)])


def _shard_axis(tensor):
    """The axis a sequence shard (a `DTensor`) is split on, else `None`."""
    if not isinstance(tensor, DTensor):
        return None
    (placement,) = tensor.placements
    return placement.dim if isinstance(placement, Shard) else None


def grad_or_zeros(tensor):
    return torch.zeros_like(tensor) if tensor.grad is None else tensor.grad


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(output, grad):
    """`grad`, this rank's part of `output`'s gradient, as `output` is."""
    if not isinstance(output, DTensor):
        return grad
    return DTensor.from_local(grad, output.device_mesh, output.placements)
