"""Workers and servers on the devices of one process (JAX, TensorFlow).

Each worker is a thread that computes on its own device, and each server
keeps its partition of the parameters and its optimizer state on a device
of its own: the shared-memory parameter server. Pushing a gradient copies
it onto the server's device; pulling copies the parameters onto the
worker's. JAX and TensorFlow release the interpreter while a device
computes, so the workers' steps run at the same time.
"""

import collections
import itertools
import queue
import threading

import numpy as np

from keras_tp.asynchronous.servers import partition_variables
from keras_tp.asynchronous.servers import weighted_mean
from keras_tp.asynchronous.staleness import StalenessBound
from keras_tp.asynchronous.workers import worker_non_trainable_values

# Keras layers are not written to be traced by two threads at once: the
# backends take this lock only while they trace (`jax.jit`, `tf.function`),
# not while their programs run.
TRACING = threading.Lock()


class InProcessServer:
    """One server: its variables' values and optimizer state on a device.

    Worker threads call `pull`, `push` and `finish`; the thread whose push
    makes an update ready applies it, under the server's lock.

    Args:
        indices: the indices of the model's trainable variables it holds.
        store: the backend's store of its parameters and optimizer state,
            on its device (`DeviceOps.server_store`).
        ops: the backend's `DeviceOps`.
        max_staleness: see `StalenessBound`.
        on_update: called with `(samples, loss)` after each update.
    """

    def __init__(self, indices, store, ops, max_staleness, on_update):
        self.indices = indices
        self.bound = StalenessBound(max_staleness)
        self._store = store
        self._ops = ops
        self._on_update = on_update
        self._condition = threading.Condition()

    @property
    def params(self):
        """The current values of the held variables, on the server."""
        return self._store.params()

    def load(self, values):
        """Sets the parameters (NumPy values of the held variables)."""
        with self._condition:
            self._store.load(values)

    def pull(self, worker):
        """The parameters, once `worker`'s last gradient is applied."""
        with self._condition:
            self._condition.wait_for(lambda: not self.bound.waits(worker))
            self.bound.start(worker)
            return self._store.params()

    def push(self, worker, gradients, samples, loss, pulls):
        """Hands over `worker`'s gradient of `samples` samples; `pulls`
        says whether the worker pulls next (see `StalenessBound.push`)."""
        gradients = self._ops.put(gradients, self._store.device)
        with self._condition:
            self.bound.push(worker, (gradients, samples, loss), pulls)
            self._apply_ready()

    def finish(self, worker):
        """`worker` has no more slices to compute."""
        with self._condition:
            self.bound.finish(worker)
            self._apply_ready()

    def _apply_ready(self):
        while self.bound.ready():
            gradients, samples, loss = weighted_mean(self.bound.take())
            self._store.apply(gradients)
            self._on_update(samples, loss)
            self._condition.notify_all()


class ThreadedRunner:
    """Runs the workers as threads and the servers on devices.

    Args:
        model: the compiled `AsyncDataParallel`.
        workers: the number of workers, one per device.
        servers: the number of servers.
        max_staleness: see `StalenessBound`.
        device_ids: the devices to use, or `None` for all.
        pull_every: a worker pulls the parameters after every
            `pull_every` pushes.
        ops: the backend's `DeviceOps`.
    """

    # The one process runs every worker, and shows the progress bar.
    reports_progress = True

    def __init__(
        self,
        model,
        workers,
        servers,
        max_staleness,
        device_ids,
        pull_every,
        ops,
    ):
        self._pull_every = pull_every
        devices = ops.devices(device_ids)
        if workers > len(devices):
            raise ValueError(
                f"AsyncDataParallel(workers={workers}) needs a device per "
                f"worker, but {len(devices)} are available. Pass "
                f"workers={len(devices)} or fewer, or create more devices "
                f"(keras_tp.configure_virtual_devices({workers + servers}) "
                "on a CPU, before Keras starts)."
            )
        self.worker_devices = devices[:workers]
        # Servers take the devices after the workers', and share workers'
        # devices when there are no more.
        self.server_devices = [
            devices[(workers + s) % len(devices)] for s in range(servers)
        ]
        self._model = model
        self._ops = ops
        self._updates = queue.Queue()
        variables = model.trainable_variables
        self.servers = []
        for s, indices in enumerate(partition_variables(variables, servers)):
            store = ops.server_store(
                model.optimizer,
                [variables[i] for i in indices],
                self.server_devices[s],
            )
            # Progress is what server 0 applied: every gradient reaches
            # every server.
            report = self._report if s == 0 else _ignore
            self.servers.append(
                InProcessServer(indices, store, ops, max_staleness, report)
            )
        self._gradient = ops.gradient_function(model)
        self._non_trainable = None

    def _report(self, samples, loss):
        self._updates.put((samples, loss))

    def load(self):
        """Copies the model's current values to the servers and workers.

        The servers take the parameters, each worker the non-trainable
        values (see `worker_non_trainable_values`).
        """
        model = self._model
        trainable = [
            self._ops.to_numpy(v.value) for v in model.trainable_variables
        ]
        for server in self.servers:
            server.load([trainable[i] for i in server.indices])
        self._non_trainable = [
            self._ops.put(worker_non_trainable_values(model, w), device)
            for w, device in enumerate(self.worker_devices)
        ]

    def trainable_values(self):
        """The servers' parameters, as NumPy, in variable order."""
        values = [None] * len(self._model.trainable_variables)
        for server in self.servers:
            for i, value in zip(server.indices, server.params):
                values[i] = self._ops.to_numpy(value)
        return values

    def non_trainable_values(self):
        """Each worker's non-trainable values, as NumPy."""
        return [
            [self._ops.to_numpy(v) for v in values]
            for values in self._non_trainable
        ]

    def staleness_histograms(self):
        """Each server's `{staleness: gradients applied}` so far."""
        return [dict(server.bound.histogram) for server in self.servers]

    def epoch_order(self, samples, shuffle):
        """The order of the samples in the next epoch."""
        if shuffle:
            return np.random.permutation(samples)
        return np.arange(samples)

    def run_epoch(self, slices):
        """Trains on `slices`, each taken by the next free worker.

        Yields:
            `(samples, loss)` after each update, as it happens.

        Raises:
            The first exception a worker raised.
        """
        pending = collections.deque(slices)
        errors = []
        # Every worker holds the parameters before any pushes, so that an
        # update cannot pass a worker whose thread has not started yet.
        workers = range(len(self.worker_devices))
        params = [self._pull(w) for w in workers]
        threads = [
            threading.Thread(
                target=self._work,
                args=(w, params[w], pending, errors),
                name=f"keras_tp-worker-{w}",
                daemon=True,
            )
            for w in workers
        ]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            try:
                yield self._updates.get(timeout=0.05)
            except queue.Empty:
                pass
        for thread in threads:
            thread.join()
        while not self._updates.empty():
            yield self._updates.get()
        if errors:
            raise errors[0]

    def _work(self, worker, params, pending, errors):
        device = self.worker_devices[worker]
        try:
            for pushes in itertools.count(1):
                try:
                    piece = pending.popleft()
                except IndexError:
                    break
                loss, gradients, self._non_trainable[worker] = self._gradient(
                    device,
                    params,
                    self._non_trainable[worker],
                    piece.x,
                    piece.y,
                    piece.sample_weight,
                )
                pulls = pushes % self._pull_every == 0
                for server in self.servers:
                    server.push(
                        worker,
                        [gradients[i] for i in server.indices],
                        piece.samples,
                        loss,
                        pulls,
                    )
                if pulls:
                    params = self._pull(worker)
        except BaseException as error:  # re-raised by run_epoch
            errors.append(error)
        finally:
            for server in self.servers:
                server.finish(worker)

    def _pull(self, worker):
        values = [None] * len(self._model.trainable_variables)
        for server in self.servers:
            for i, value in zip(server.indices, server.pull(worker)):
                values[i] = value
        return self._ops.put(values, self.worker_devices[worker])


def runner_factory(ops_class):
    """The `make_runner` of a backend whose workers are threads.

    Args:
        ops_class: the backend's `DeviceOps` class. Its
            `server_store(optimizer, variables, device)` makes a server's
            store: its parameters and optimizer state on `device`, for the
            model `variables` it holds, with a copy of the compiled
            `optimizer` (`server_optimizer`).
    """

    def make_runner(*arguments):
        # `(model, workers, servers, max_staleness, device_ids, pull_every)`
        return ThreadedRunner(*arguments, ops_class())

    return make_runner


def _ignore(samples, loss):
    del samples, loss
