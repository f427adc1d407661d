"""Pipeline stages on TensorFlow: one traced step, each stage on its device.

The whole step is one `tf.function`. Each action of the schedule
(`keras_tp.pipeline.schedules`) runs under `tf.device` of its stage: a
forward pass records its own `GradientTape`, the matching backward pass
asks that tape for the stage's gradients and for the gradients of the
tensors it received, which go to the previous stage's device. Control
dependencies chain each stage's actions in the schedule's order, so a
stage runs one micro-batch at a time and a 1F1B order bounds the
activations it holds; TensorFlow's executor runs the actions of
different stages at the same time where the data allows.
"""

import tensorflow as tf

from keras_tp.collectives.base import nbytes
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runner import ScheduledStages


class TensorFlowPipeline(ScheduledStages):
    """The stages of a pipeline, each run on its own device.

    Args: those of `ScheduledStages`; `devices` are TensorFlow device names.
    """

    def __init__(
        self, stage_models, devices, loss, schedule, num_microbatches, stats
    ):
        super().__init__(
            stage_models, devices, loss, schedule, num_microbatches, stats
        )
        # The loop over the schedule unrolls when traced: one action after
        # the other, as written, not a graph loop.
        self.step = tf.function(self._recorded_step, autograph=False)

    def _recorded_step(self, x, y):
        # Runs when the step is traced: the traced step sends the same
        # tensors at every call, as the records say.
        with self.stats.recording("train"):
            return self._step(x, y)

    def _step(self, x, y):
        """One batch's forward and backward passes (see `step`).

        Returns:
            `(loss, gradients)`: the batch's mean loss and each stage's
            gradients of it, summed over the micro-batches.
        """
        count = self.num_microbatches
        last = len(self.stage_models) - 1
        # Traced per input signature: the batch size is known here.
        batch = tf.nest.flatten(x)[0].shape[0]
        schedules.check_microbatches(batch, count)
        size = batch // count

        def microbatch(structure, m):
            return tf.nest.map_structure(
                lambda a: a[m * size : (m + 1) * size], structure
            )

        targets = [microbatch(y, m) for m in range(count)]
        received = {(0, m): microbatch(x, m) for m in range(count)}
        tapes, results, cotangents = {}, {}, {}
        gradients = [None] * len(self.stage_models)
        previous = [[] for _ in self.stage_models]
        loss = 0.0
        for stage, kind, m in self.order:
            model = self.stage_models[stage]
            with (
                tf.device(self.devices[stage]),
                tf.control_dependencies(previous[stage]),
            ):
                if kind == schedules.FORWARD:
                    received_inputs = tf.nest.map_structure(
                        tf.identity, received.pop((stage, m))
                    )
                    with tf.GradientTape() as tape:
                        tape.watch(_floating(received_inputs))
                        outputs = model(received_inputs, training=True)
                        if stage == last:
                            outputs = self.loss(targets[m], outputs) / count
                    tapes[stage, m] = tape
                    results[stage, m] = (received_inputs, outputs)
                    previous[stage] = tf.nest.flatten(outputs)
                    if stage == last:
                        loss = loss + outputs
                        continue
                    for tensor in tf.nest.flatten(outputs):
                        self.stats.record(
                            "send", nbytes(tensor), "forward", "pipe"
                        )
                    received[stage + 1, m] = outputs
                    continue
                received_inputs, outputs = results.pop((stage, m))
                variables = model.trainable_variables
                sources = [*variables, *_floating(received_inputs)]
                # Integer tensors (a carried padding mask) take no part:
                # gradients flow between the floating-point ones only.
                grads = tapes.pop((stage, m)).gradient(
                    outputs if stage == last else _floating(outputs),
                    sources if stage else variables,
                    output_gradients=(
                        None if stage == last else cotangents.pop((stage, m))
                    ),
                )
                previous[stage] = [g for g in grads if g is not None]
                stage_grads = [
                    tf.convert_to_tensor(g) for g in grads[: len(variables)]
                ]
                gradients[stage] = (
                    stage_grads
                    if gradients[stage] is None
                    else [a + b for a, b in zip(gradients[stage], stage_grads)]
                )
                if stage:
                    sent = grads[len(variables) :]
                    for tensor in sent:
                        self.stats.record(
                            "send", nbytes(tensor), "backward", "pipe"
                        )
                    cotangents[stage - 1, m] = sent
        return loss, gradients


def _floating(structure):
    """The floating-point tensors of `structure`, in `tf.nest` order (the
    same on both sides of a cut)."""
    return [t for t in tf.nest.flatten(structure) if t.dtype.is_floating]
