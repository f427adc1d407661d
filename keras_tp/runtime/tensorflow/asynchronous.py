"""TensorFlow side of `AsyncDataParallel`: worker threads on logical devices.

A worker's step is a `tf.function` placed on the worker's device; a
server's update is the optimizer's `stateless_apply` in a `tf.function`
placed on the server's device.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_tp.asynchronous.servers import server_optimizer
from keras_tp.asynchronous.threads import TRACING
from keras_tp.asynchronous.threads import runner_factory
from keras_tp.asynchronous.workers import stateless_loss
from keras_tp.runtime.base import select_devices
from keras_tp.runtime.tensorflow.devices import device_name


class ServerStore:
    """A server's parameters and optimizer state: variables on its device.

    Keras' TensorFlow optimizers update variables, not values
    (`stateless_apply` is refused there), so the server holds variables
    of its own, created on its device with the optimizer's slots.
    """

    def __init__(self, optimizer, variables, device):
        self.device = device
        with tf.device(device):
            self._variables = [
                keras.Variable(
                    np.zeros(v.shape, v.dtype), dtype=v.dtype, name=v.name
                )
                for v in variables
            ]
            self._optimizer = server_optimizer(optimizer, self._variables)

    def load(self, values):
        for variable, value in zip(self._variables, values):
            variable.assign(value)

    def params(self):
        # Read now, under the server's lock: a worker copies them to its
        # device after the lock is released, when an update may be running.
        with tf.device(self.device):
            return [tf.identity(variable.value) for variable in self._variables]

    @tf.function
    def apply(self, gradients):
        with TRACING, tf.device(self.device):
            self._optimizer.apply(gradients, self._variables)


class DeviceOps:
    """What `ThreadedRunner` needs of TensorFlow."""

    def devices(self, device_ids):
        logical = tf.config.list_logical_devices("GPU")
        logical = logical or tf.config.list_logical_devices("CPU")
        available = [device_name(device.name) for device in logical]
        return select_devices("tensorflow", available, None, device_ids)

    def put(self, values, device):
        with tf.device(device):
            return [tf.identity(value) for value in values]

    def to_numpy(self, value):
        return value.numpy()

    def gradient_function(self, model):
        @tf.function
        def gradient(device, trainable, non_trainable, x, y, sample_weight):
            with TRACING, tf.device(device):
                with tf.GradientTape() as tape:
                    tape.watch(trainable)
                    loss, non_trainable = stateless_loss(
                        model, trainable, non_trainable, x, y, sample_weight
                    )
                return loss, tape.gradient(loss, trainable), non_trainable

        def step(device, trainable, non_trainable, x, y, sample_weight):
            loss, gradients, non_trainable = gradient(
                device, trainable, non_trainable, x, y, sample_weight
            )
            return float(loss), gradients, non_trainable

        return step

    # A server's store (see `runner_factory`).
    server_store = ServerStore


# The runner of `AsyncDataParallel` (see `runner_factory`).
make_runner = runner_factory(DeviceOps)
