"""The worker and server processes of `AsyncDataParallel` on torch.

`keras_tp.runtime.torch.asynchronous` gives each rank its role; this
module is what a role does within an epoch: the messages a worker and a
server exchange, and how server 0 shares out the work. A server holds its
partition's parameters and optimizer state and applies what the workers
push when `StalenessBound` says; a worker computes gradients from the
parameters it last pulled.

The messages are point-to-point, as CPU tensors over gloo (also beside
nccl on GPUs, which cannot receive from any rank):

- worker -> each server, per push: a header (float64: kind, samples, the
  slice's loss, whether the worker pulls next; counts are exact in
  float64, and the loss travels as the worker computed it), then the
  server's part of the gradient as one flat tensor; at the end of the
  epoch a header that says the worker finished.
- server 0 -> worker, answering each push: a ticket (int64: the worker's
  next slice, or -1 when every slice is taken, and how many updates
  follow), then the `(samples, loss)` of each update server 0 applied
  since the worker's previous ticket. A push the worker pulls after is
  answered with the parameters, once its update is applied: only then is
  the worker free to take a slice.
- each server -> worker, right after the update that applied the
  worker's pulling push: the server's parameters, flat.

A server receives headers from any rank (`dist.recv(src=None)`); headers
have a tag of their own, so that such a receive never matches the
gradient that follows another worker's header.

**Work sharing.** Server 0 hands out the slices. It receives every push,
in the order they arrive, and answers each with the next slice when the
worker is free: at once after a push it does not pull after, with the
parameters after one it pulls after, as the worker threads pop theirs
from one queue when they are free. The answer is a message the worker
waits for anyway, so it costs no round trip of its own; it needs no
counter in the rendezvous store, whose keys would have to be kept apart
across fits and elastic restarts; and it brings the global progress
with it, so every worker yields every worker's updates and rank 0's
progress bar advances per global batch.
"""

import functools
import math

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.asynchronous.servers import server_optimizer
from keras_tp.asynchronous.servers import weighted_mean
from keras_tp.asynchronous.staleness import StalenessBound
from keras_tp.asynchronous.workers import stateless_loss
from keras_tp.runtime.torch.storage import from_numpy

# What a worker's header announces.
_PUSH = 0
_FINISH = 1

# Message tags. Headers have their own: a server receives them from any
# rank, and must never match the gradient that follows another header.
_HEADER_TAG = 1
_GRADIENT_TAG = 2
_TICKET_TAG = 3
_UPDATES_TAG = 4
_PARAMETERS_TAG = 5

# The ticket's slice when every slice of the epoch is taken.
_NO_SLICE = -1


class FlatLayout:
    """How the values of some variables travel as one flat CPU tensor.

    Args:
        variables: the Keras variables, in the order they travel.
    """

    def __init__(self, variables):
        self.shapes = [tuple(v.shape) for v in variables]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.dtypes = [v.value.dtype for v in variables]
        # One dtype that holds each variable's exactly.
        self.dtype = functools.reduce(torch.promote_types, self.dtypes)

    def empty(self):
        """A flat tensor to receive into."""
        return torch.empty(sum(self.sizes), dtype=self.dtype)

    def flatten(self, tensors):
        """`tensors` (one per variable) as one new flat CPU tensor."""
        return torch.cat(
            [t.detach().reshape(-1).to("cpu", self.dtype) for t in tensors]
        )

    def split(self, flat, device):
        """The variables' tensors in `flat`, on `device`."""
        return [
            piece.reshape(shape).to(device, dtype)
            for piece, shape, dtype in zip(
                torch.split(flat, self.sizes), self.shapes, self.dtypes
            )
        ]


class Outbox:
    """Sends that complete in the background.

    Each tensor is kept until its send completes: gloo reads it while the
    receiver takes it.
    """

    def __init__(self):
        self._pending = []

    def send(self, tensor, rank, tag):
        """Starts sending `tensor` to `rank` with `tag`; returns at once."""
        self._pending = [
            (work, sent)
            for work, sent in self._pending
            if not work.is_completed()
        ]
        self._pending.append((dist.isend(tensor, rank, tag=tag), tensor))

    def flush(self):
        """Waits until every send completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


class ServerProcess:
    """This rank as a server: its partition, optimizer state and bound.

    Its variables are its own, not the model's: the parameters and the
    optimizer state of its partition are all the tensors it keeps.

    Args:
        index: the server's index.
        variables: the model variables of its partition.
        layout: the `FlatLayout` of its partition.
        optimizer: the compiled optimizer, copied for this server.
        workers: the number of workers.
        max_staleness: see `StalenessBound`.
    """

    def __init__(
        self, index, variables, layout, optimizer, workers, max_staleness
    ):
        self.index = index
        self.variables = [
            keras.Variable(
                np.zeros(v.shape, v.dtype), dtype=v.dtype, name=v.name
            )
            for v in variables
        ]
        self.optimizer = server_optimizer(optimizer, self.variables)
        self.bound = StalenessBound(max_staleness)
        self._layout = layout
        self._workers = workers
        self._outbox = Outbox()
        # Server 0's `(samples, loss)` of each update of the epoch.
        self.updates = []

    def load(self, values):
        """Sets the parameters (NumPy values of the partition)."""
        for variable, value in zip(self.variables, values):
            variable.assign(value)

    def parameters(self):
        """The parameters, flat."""
        return self._layout.flatten([v.value for v in self.variables])

    def run_epoch(self, slices):
        """Serves the workers until every one finished the epoch.

        Every worker starts from the parameters the ranks share.

        Args:
            slices: the epoch's slices (server 0 hands them out).

        Yields:
            Server 0: `(samples, loss)` after each update. The other
            servers yield nothing.
        """
        workers = self._workers
        for worker in range(workers):
            self.bound.start(worker)
        self.updates = []
        # What server 0's tickets need: the next slice to hand out, and
        # how many of `updates` each worker has been told of.
        slice_count = len(slices)
        next_slice = min(workers, slice_count)
        told = [0] * workers
        finished = set()
        pulling = set()

        def hand_out(worker, next_slice):
            """Sends `worker` its ticket; returns the next slice after."""
            given = next_slice if next_slice < slice_count else _NO_SLICE
            self._send_ticket(worker, given, self.updates[told[worker] :])
            told[worker] = len(self.updates)
            return next_slice + (given != _NO_SLICE)

        header = torch.empty(4, dtype=torch.float64)
        while len(finished) < workers:
            # Worker ranks are the workers' indices.
            worker = dist.recv(header, src=None, tag=_HEADER_TAG)
            kind, samples, loss, pulls = header.tolist()
            if kind == _FINISH:
                self.bound.finish(worker)
                finished.add(worker)
            else:
                gradient = self._layout.empty()
                dist.recv(gradient, src=worker, tag=_GRADIENT_TAG)
                self.bound.push(
                    worker, ([gradient], int(samples), loss), pulls=bool(pulls)
                )
                if pulls:
                    pulling.add(worker)
                elif self.index == 0:
                    next_slice = hand_out(worker, next_slice)
            while self.bound.ready():
                group = self.bound.take()
                (gradient,), samples, loss = weighted_mean(group)
                self._apply(gradient)
                if self.index == 0:
                    self.updates.append((samples, loss))
                    yield samples, loss
                # `take` takes every waiting gradient: the group's pulling
                # workers have nothing left to wait for.
                applied = {pushed.worker for pushed in group}
                replies = sorted(applied & pulling)
                if replies:
                    parameters = self.parameters()
                    for worker in replies:
                        if self.index == 0:
                            next_slice = hand_out(worker, next_slice)
                        self._outbox.send(parameters, worker, _PARAMETERS_TAG)
                    pulling -= applied
        self._outbox.flush()

    def _send_ticket(self, worker, next_slice, updates):
        self._outbox.send(
            torch.tensor([next_slice, len(updates)], dtype=torch.int64),
            worker,
            _TICKET_TAG,
        )
        if updates:
            self._outbox.send(
                torch.tensor(updates, dtype=torch.float64), worker, _UPDATES_TAG
            )

    def _apply(self, gradient):
        device = self.variables[0].value.device
        with torch.no_grad():
            self.optimizer.apply(
                self._layout.split(gradient, device), self.variables
            )


class WorkerProcess:
    """This rank as a worker: the parameters it computes from.

    Args:
        index: the worker's index (its rank).
        model: the compiled `AsyncDataParallel`.
        partitions: the variable indices each server holds.
        layouts: the `FlatLayout` of each server's partition.
        pull_every: the worker pulls after every `pull_every` pushes.
    """

    def __init__(self, index, model, partitions, layouts, pull_every):
        self.index = index
        self._model = model
        self._partitions = partitions
        self._layouts = layouts
        self._pull_every = pull_every
        self._server_ranks = list(
            range(model.workers, model.workers + len(layouts))
        )
        self._device = model.trainable_variables[0].value.device
        self._outbox = Outbox()
        self._parameters = None
        self.non_trainable = None

    def load(self, trainable, non_trainable):
        """Sets the parameters and non-trainable values (NumPy)."""
        self._parameters = [self._tensor(value) for value in trainable]
        self.non_trainable = [self._tensor(value) for value in non_trainable]

    def _tensor(self, value):
        return from_numpy(np.asarray(value)).to(self._device)

    def set_parameters(self, flats):
        """Takes each server's flat parameters."""
        for indices, layout, flat in zip(
            self._partitions, self._layouts, flats
        ):
            for i, value in zip(indices, layout.split(flat, self._device)):
                self._parameters[i] = value

    def run_epoch(self, slices):
        """Computes slices until server 0 has none left for it.

        The worker starts on slice `index` of the epoch, and takes each
        next one from server 0's answer to its push.

        Yields:
            `(samples, loss)` of each update server 0 applied, as server 0
            reports them.
        """
        next_slice = self.index if self.index < len(slices) else _NO_SLICE
        pushes = 0
        while next_slice != _NO_SLICE:
            piece = slices[next_slice]
            loss, gradients = self._gradient(piece)
            pushes += 1
            pulls = pushes % self._pull_every == 0
            header = torch.tensor(
                [_PUSH, piece.samples, loss, pulls], dtype=torch.float64
            )
            for rank, indices, layout in zip(
                self._server_ranks, self._partitions, self._layouts
            ):
                self._outbox.send(header, rank, _HEADER_TAG)
                self._outbox.send(
                    layout.flatten([gradients[i] for i in indices]),
                    rank,
                    _GRADIENT_TAG,
                )
            next_slice, updates = self._receive_ticket()
            yield from updates
            if pulls:
                self._pull()
        finish = torch.tensor([_FINISH, 0, 0, 0], dtype=torch.float64)
        for rank in self._server_ranks:
            self._outbox.send(finish, rank, _HEADER_TAG)
        self._outbox.flush()

    def _gradient(self, piece):
        """`(loss, gradients)` of a slice; updates the non-trainable values."""
        leaves = [p.detach().requires_grad_() for p in self._parameters]
        x, y, sample_weight = (
            _tensors(piece.x),
            _tensors(piece.y),
            _tensors(piece.sample_weight),
        )
        loss, non_trainable = stateless_loss(
            self._model, leaves, self.non_trainable, x, y, sample_weight
        )
        gradients = torch.autograd.grad(loss, leaves, allow_unused=True)
        self.non_trainable = [value.detach() for value in non_trainable]
        gradients = [
            torch.zeros_like(leaf) if gradient is None else gradient
            for leaf, gradient in zip(leaves, gradients)
        ]
        return float(loss.detach()), gradients

    def _receive_ticket(self):
        ticket = torch.empty(2, dtype=torch.int64)
        dist.recv(ticket, src=self._server_ranks[0], tag=_TICKET_TAG)
        next_slice, count = ticket.tolist()
        if not count:
            return next_slice, []
        updates = torch.empty((count, 2), dtype=torch.float64)
        dist.recv(updates, src=self._server_ranks[0], tag=_UPDATES_TAG)
        return next_slice, [(int(s), loss) for s, loss in updates.tolist()]

    def _pull(self):
        flats = [layout.empty() for layout in self._layouts]
        works = [
            dist.irecv(flat, src=rank, tag=_PARAMETERS_TAG)
            for flat, rank in zip(flats, self._server_ranks)
        ]
        for work in works:
            work.wait()
        self.set_parameters(flats)


def _tensors(value):
    """A slice's arrays (or structure of arrays, or `None`) as tensors."""
    if value is None:
        return None
    return keras.tree.map_structure(keras.ops.convert_to_tensor, value)
