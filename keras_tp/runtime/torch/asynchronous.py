"""torch side of `AsyncDataParallel`: a process per worker and per server.

Every rank runs the same training code, and its rank gives its role: ranks
`0 .. workers - 1` are the workers (rank 0, whose result `keras_tp.launch`
returns, is worker 0 and shows the progress bar), ranks `workers ..
workers + servers - 1` the servers. Server `s` holds partition `s` of the
trainable variables (`partition_variables`) and a copy of the compiled
optimizer built on it, and applies what the workers push when
`StalenessBound` says, the rule the worker threads of JAX and TensorFlow
follow. What the roles do within an epoch, the messages they exchange
and how server 0 shares out the slices, is
`keras_tp.runtime.torch.async_processes`; this module starts them, and
joins the ranks between epochs.

**End of an epoch.** Once every worker was told -1 and finished and every
server applied what it received, all ranks meet in collectives: each
server broadcasts its partition, and an all-gather brings every worker's
non-trainable values, every server's staleness histogram and server 0's
list of updates to every rank. Every rank then yields the same updates,
writes back the same values, validates locally and returns the same
history.
"""

import numpy as np
import torch
import torch.distributed as dist

from keras_tp.asynchronous.servers import partition_variables
from keras_tp.asynchronous.workers import worker_non_trainable_values
from keras_tp.runtime.torch.async_processes import FlatLayout
from keras_tp.runtime.torch.async_processes import ServerProcess
from keras_tp.runtime.torch.async_processes import WorkerProcess
from keras_tp.runtime.torch.devices import join_ranks
from keras_tp.runtime.torch.storage import to_numpy


class ProcessRunner:
    """Runs this rank's part of `AsyncDataParallel` on torch.

    Ranks `0 .. workers - 1` are workers (`WorkerProcess`), the others
    servers (`ServerProcess`); see the module's docstring.

    Args:
        model: the compiled `AsyncDataParallel`.
        workers: the number of workers.
        servers: the number of servers.
        max_staleness: see `StalenessBound`.
        pull_every: a worker pulls the parameters after every
            `pull_every` pushes.

    Raises:
        ValueError: if the process group has other than `workers +
            servers` ranks.
    """

    def __init__(self, model, workers, servers, max_staleness, pull_every):
        join_ranks(
            workers + servers,
            caller=f"AsyncDataParallel(workers={workers}, servers={servers})",
            counted=" (one per worker and per server)",
        )
        self.rank = dist.get_rank()
        # Rank 0 is worker 0: `keras_tp.launch` returns its result.
        self.reports_progress = self.rank == 0
        self._model = model
        self._workers = workers
        variables = model.trainable_variables
        self._partitions = partition_variables(variables, servers)
        self._layouts = [
            FlatLayout([variables[i] for i in indices])
            for indices in self._partitions
        ]
        if self.rank < workers:
            self.role = WorkerProcess(
                self.rank, model, self._partitions, self._layouts, pull_every
            )
        else:
            index = self.rank - workers
            self.role = ServerProcess(
                index,
                [variables[i] for i in self._partitions[index]],
                self._layouts[index],
                model.optimizer,
                workers,
                max_staleness,
            )
        self._trainable = None
        self._non_trainable = None
        self._histograms = [{} for _ in range(servers)]

    def load(self):
        """Gives every rank rank 0's values, and the servers and workers
        theirs.

        Ranks may have built the model with different initial values;
        rank 0's is the model `keras_tp.launch` returns.
        """
        model = self._model
        variables = model.trainable_variables + model.non_trainable_variables
        for variable, value in zip(variables, _broadcast_values(variables)):
            variable.assign(value)
        self._trainable = [
            to_numpy(v.value.detach()) for v in model.trainable_variables
        ]
        self._non_trainable = [
            worker_non_trainable_values(model, worker)
            for worker in range(self._workers)
        ]
        if isinstance(self.role, WorkerProcess):
            self.role.load(self._trainable, self._non_trainable[self.rank])
        else:
            indices = self._partitions[self.role.index]
            self.role.load([self._trainable[i] for i in indices])

    def epoch_order(self, samples, shuffle):
        """The order of the samples in the next epoch: rank 0's, on every
        rank."""
        if not shuffle:
            return np.arange(samples)
        order = torch.from_numpy(np.random.permutation(samples))
        dist.broadcast(order, src=0)
        return order.numpy()

    def run_epoch(self, slices):
        """Runs this rank's worker or server through `slices`.

        Yields:
            `(samples, loss)` of each update, as server 0 applied them:
            the same on every rank, some as they happen (worker ranks,
            server 0), the rest at the end of the epoch.
        """
        yielded = 0
        for update in self.role.run_epoch(slices):
            yielded += 1
            yield update
        updates = self._end_epoch()
        yield from updates[yielded:]

    def _end_epoch(self):
        """Shares the epoch's outcome with every rank; server 0's updates."""
        flats = []
        for index, layout in enumerate(self._layouts):
            server_rank = self._workers + index
            if self.rank == server_rank:
                flat = self.role.parameters()
            else:
                flat = layout.empty()
            dist.broadcast(flat, src=server_rank)
            flats.append(flat)
        for indices, layout, flat in zip(
            self._partitions, self._layouts, flats
        ):
            for i, value in zip(indices, layout.split(flat, "cpu")):
                self._trainable[i] = to_numpy(value)
        if isinstance(self.role, WorkerProcess):
            self.role.set_parameters(flats)
            state = {
                "non_trainable": [to_numpy(v) for v in self.role.non_trainable]
            }
        else:
            state = {
                "histogram": dict(self.role.bound.histogram),
                "updates": self.role.updates,
            }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        workers = self._workers
        self._non_trainable = [s["non_trainable"] for s in gathered[:workers]]
        self._histograms = [s["histogram"] for s in gathered[workers:]]
        return gathered[workers]["updates"]

    def trainable_values(self):
        """The servers' parameters, as NumPy, in variable order."""
        return self._trainable

    def non_trainable_values(self):
        """Each worker's non-trainable values, as NumPy."""
        return self._non_trainable

    def staleness_histograms(self):
        """Each server's `{staleness: gradients applied}` so far."""
        return [dict(histogram) for histogram in self._histograms]


def _broadcast_values(variables):
    """Rank 0's values of `variables`, as torch tensors on every rank.

    They travel as the bytes of one flat tensor, whatever their dtypes.
    """
    values = [v.value.detach().cpu().contiguous() for v in variables]
    flat = torch.cat([value.reshape(-1).view(torch.uint8) for value in values])
    dist.broadcast(flat, src=0)
    sizes = [value.numel() * value.element_size() for value in values]
    # Cloned: a piece's offset in `flat` need not suit its dtype's size.
    return [
        piece.clone().view(value.dtype).reshape(value.shape)
        for piece, value in zip(torch.split(flat, sizes), values)
    ]


def make_runner(model, workers, servers, max_staleness, device_ids, pull_every):
    """The runner of `AsyncDataParallel` on torch (`ProcessRunner`).

    Raises:
        ValueError: if `device_ids` is given: each rank is a process with
            its own device.
    """
    if device_ids is not None:
        raise ValueError(
            f"AsyncDataParallel(device_ids={device_ids!r}): on torch each "
            "worker and server is a process with its own device (cuda:"
            "LOCAL_RANK, or the CPU), so there are no devices to choose. "
            "Leave device_ids out."
        )
    return ProcessRunner(model, workers, servers, max_staleness, pull_every)
