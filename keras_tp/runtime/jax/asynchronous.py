"""JAX side of `AsyncDataParallel`: worker threads on the mesh's devices.

A worker's step is one jitted program, run on the device its parameters
are committed to; a server's update is the optimizer's `stateless_apply`,
jitted and run on the server's device.
"""

import jax
import keras
import numpy as np

from keras_tp.asynchronous.servers import server_optimizer
from keras_tp.asynchronous.threads import TRACING
from keras_tp.asynchronous.threads import runner_factory
from keras_tp.asynchronous.workers import stateless_loss
from keras_tp.runtime.base import select_devices
from keras_tp.runtime.jax.devices import to_jax_device


class ServerStore:
    """A server's parameters and optimizer state: arrays on its device."""

    def __init__(self, optimizer, variables, device):
        self.device = device
        self._optimizer = server_optimizer(optimizer, variables)
        self._slots = [
            jax.device_put(v.value, device) for v in self._optimizer.variables
        ]
        # Runs where its inputs are: on the server's device.
        self._apply = jax.jit(self._optimizer.stateless_apply)
        self._params = None

    def load(self, values):
        self._params = [jax.device_put(v, self.device) for v in values]

    def params(self):
        return self._params

    def apply(self, gradients):
        self._params, self._slots = self._apply(
            self._slots, gradients, self._params
        )


class DeviceOps:
    """What `ThreadedRunner` needs of JAX."""

    def devices(self, device_ids):
        names = select_devices(
            "jax", keras.distribution.list_devices(), None, device_ids
        )
        return [to_jax_device(name) for name in names]

    def put(self, values, device):
        return [jax.device_put(value, device) for value in values]

    def to_numpy(self, value):
        return np.asarray(value)

    def gradient_function(self, model):
        def loss(trainable, non_trainable, x, y, sample_weight):
            with TRACING:
                return stateless_loss(
                    model, trainable, non_trainable, x, y, sample_weight
                )

        gradient = jax.jit(jax.value_and_grad(loss, has_aux=True))

        def step(device, trainable, non_trainable, x, y, sample_weight):
            x, y, sample_weight = jax.device_put((x, y, sample_weight), device)
            (value, non_trainable), gradients = gradient(
                trainable, non_trainable, x, y, sample_weight
            )
            return float(value), gradients, non_trainable

        return step

    # A server's store (see `runner_factory`).
    server_store = ServerStore


# The runner of `AsyncDataParallel` (see `runner_factory`).
make_runner = runner_factory(DeviceOps)
