"""Pipeline stages on JAX: one compiled program per stage, on its device.

Each stage's forward pass is a jitted `jax.vjp` of the stage's Keras
model on that stage's device; it returns the stage's outputs and the
`VJP` that holds its residuals (the activations the backward pass
needs). Each backward pass is a jitted call of one such `VJP`. Python
issues the actions in the order of a schedule (`keras_tp.pipeline.
schedules`), and JAX's asynchronous dispatch lets the devices of
different stages compute at the same time: a stage's call returns at
once, and an array sent to the next stage's device is copied when it is
ready. The activations of a micro-batch live in its `VJP` from its
forward pass to its backward pass, so a 1F1B order holds fewer of them
than GPipe's.
"""

import jax
import numpy as np

from keras_tp.collectives.base import nbytes
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runner import ScheduledStages


class JaxPipeline(ScheduledStages):
    """The stages of a pipeline, each compiled for its own device.

    Args: those of `ScheduledStages`; `devices` are `jax.Device`s.
    """

    def __init__(
        self, stage_models, devices, loss, schedule, num_microbatches, stats
    ):
        super().__init__(
            stage_models, devices, loss, schedule, num_microbatches, stats
        )
        self._forwards = [
            jax.jit(self._forward_of(index))
            for index in range(len(stage_models))
        ]
        self._backward = jax.jit(lambda vjp, cotangent: vjp(cotangent))
        self.peak_activations = []

    def _forward_of(self, index):
        model = self.stage_models[index]
        last = index == len(self.stage_models) - 1
        microbatches = self.num_microbatches

        def forward(trainable, non_trainable, inputs, targets):
            def stage(trainable, inputs):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, inputs, training=True
                )
                if last:
                    # Each micro-batch's share of the batch's mean loss.
                    outputs = self.loss(targets, outputs) / microbatches
                return outputs, new_non_trainable

            outputs, vjp, new_non_trainable = jax.vjp(
                stage, trainable, inputs, has_aux=True
            )
            return outputs, vjp, new_non_trainable

        return forward

    def step(self, trainable, non_trainable, x, y):
        """Runs the forward and backward passes of one batch.

        Args:
            trainable: each stage's trainable values, on its device.
            non_trainable: each stage's non-trainable values.
            x: the batch's inputs (NumPy or JAX arrays).
            y: the batch's targets.

        Returns:
            `(loss, gradients, non_trainable)`: the batch's mean loss,
            each stage's gradients summed over the micro-batches (of the
            mean loss), and each stage's new non-trainable values.
            `peak_activations` then holds, per stage, the most
            micro-batches whose activations it held at once.
        """
        count = self.num_microbatches
        batch = len(jax.tree_util.tree_leaves(x)[0])
        schedules.check_microbatches(batch, count)
        size = batch // count

        def microbatch(tree, m):
            return jax.tree_util.tree_map(
                lambda a: np.asarray(a)[m * size : (m + 1) * size], tree
            )

        last = len(self.stage_models) - 1
        targets = [microbatch(y, m) for m in range(count)]
        received = {(0, m): microbatch(x, m) for m in range(count)}
        cotangents = {}
        vjps = {}
        non_trainable = list(non_trainable)
        gradients = [None] * len(self.stage_models)
        loss = 0.0
        in_flight = [0] * len(self.stage_models)
        self.peak_activations = [0] * len(self.stage_models)
        for stage, kind, m in self.order:
            device = self.devices[stage]
            if kind == schedules.FORWARD:
                in_flight[stage] += 1
                self.peak_activations[stage] = max(
                    self.peak_activations[stage], in_flight[stage]
                )
                outputs, vjps[stage, m], non_trainable[stage] = self._forwards[
                    stage
                ](
                    trainable[stage],
                    non_trainable[stage],
                    jax.device_put(received.pop((stage, m)), device),
                    targets[m] if stage == last else None,
                )
                if stage == last:
                    loss = loss + outputs
                    continue
                for tensor in jax.tree_util.tree_leaves(outputs):
                    self.stats.record("send", nbytes(tensor), "forward", "pipe")
                received[stage + 1, m] = outputs
                continue
            in_flight[stage] -= 1
            cotangent = (
                np.float32(1.0)
                if stage == last
                else jax.device_put(cotangents.pop((stage, m)), device)
            )
            grads, input_grads = self._backward(vjps.pop((stage, m)), cotangent)
            gradients[stage] = (
                grads
                if gradients[stage] is None
                else jax.tree_util.tree_map(
                    lambda a, b: a + b, gradients[stage], grads
                )
            )
            if stage > 0:
                for tensor in jax.tree_util.tree_leaves(input_grads):
                    # Integer inputs (a carried padding mask) have empty
                    # `float0` gradients, which carry no data.
                    if tensor.dtype != jax.dtypes.float0:
                        self.stats.record(
                            "send", nbytes(tensor), "backward", "pipe"
                        )
                cotangents[stage - 1, m] = input_grads
        return loss, gradients, non_trainable
