"""The one executor of a pipeline schedule, over a backend's stage primitives.

A schedule (`keras_tp.pipeline.schedules`) is data: a list of `Action`s
`(stage, kind, microbatch)`. This module runs such a list, the same way on
every backend, in the manner of torch's `_PipelineScheduleRuntime`: it
routes each micro-batch's activations forward and their gradients back,
collects the last stage's losses and outputs, and leaves every
computation and every transfer to a `StagePrimitives` object that the
backend supplies (a jitted pass on JAX, a replica step on TensorFlow).

Example:

```python
order = schedules.issue_order("1f1b", num_stages=2, num_microbatches=4)
loss, y_pred = run_schedule(primitives, order, x, y)
```
"""

from keras_tp.pipeline import schedules


class StagePrimitives:
    """What a backend supplies for the executor to run a pipeline's actions.

    Subclasses implement the passes of one stage on one micro-batch; the
    executor decides which runs when and routes the values between them.

    Attributes:
        num_stages: the number of stages.
    """

    num_stages = None

    def microbatches(self, x, y):
        """`(inputs, targets)`: the first stage's inputs and the last
        stage's targets of each micro-batch, in order (`y` may be `None`
        for forward-only passes, then `targets` is too)."""
        raise NotImplementedError

    def forward(self, stage, m, inputs, target):
        """Runs micro-batch `m`'s forward pass of `stage` for training.

        Args:
            stage: the stage's index.
            m: the micro-batch's index.
            inputs: what the stage received (see `send`).
            target: the micro-batch's targets on the last stage, else
                `None`.

        Returns:
            `(outputs, predicted)`: what the stage sends on or, on the last
            stage, its share of the batch's loss, with the stage's outputs
            (`None` on other stages).
        """
        raise NotImplementedError

    def backward(self, stage, m, cotangent):
        """Runs micro-batch `m`'s backward pass of `stage` and adds its
        gradients to the stage's total for the step.

        Args:
            stage: the stage's index.
            m: the micro-batch's index.
            cotangent: the gradients of the stage's outputs, as received
                (`None` on the last stage, whose output is the loss).

        Returns:
            The gradients of the stage's inputs, for the previous stage.
        """
        raise NotImplementedError

    def send(self, value, stage, direction):
        """Moves `value` to the devices of `stage` and counts it.

        Args:
            value: activations (`direction="forward"`) or their gradients
                (`"backward"`).
            stage: the index of the receiving stage.
            direction: `"forward"` or `"backward"`.

        Returns:
            The value as the receiving stage reads it.
        """
        return value

    def infer(self, stage, inputs):
        """A stage's forward pass of one micro-batch, without gradients."""
        raise NotImplementedError

    def joined(self, losses, predictions):
        """`(loss, y_pred)` of the batch from each micro-batch's loss share
        and outputs, in micro-batch order."""
        raise NotImplementedError


def run_schedule(primitives, order, x, y):
    """Runs one batch's forward and backward passes in the order given.

    Args:
        primitives: the backend's `StagePrimitives`.
        order: the `Action`s to run, each after the ones it needs
            (`schedules.issue_order`).
        x: the batch's inputs.
        y: the batch's targets.

    Returns:
        `(loss, y_pred)` of the batch, as `primitives.joined` makes them;
        each stage's gradients are then held by `primitives`.
    """
    last = primitives.num_stages - 1
    inputs, targets = primitives.microbatches(x, y)
    received = {(0, m): part for m, part in enumerate(inputs)}
    cotangents = {}
    losses, predictions = [], [None] * len(inputs)
    for stage, kind, m in order:
        if kind == schedules.FORWARD:
            outputs, predicted = primitives.forward(
                stage,
                m,
                received.pop((stage, m)),
                targets[m] if stage == last else None,
            )
            if stage == last:
                losses.append(outputs)
                predictions[m] = predicted
            else:
                received[stage + 1, m] = primitives.send(
                    outputs, stage + 1, schedules.FORWARD
                )
            continue
        sent = primitives.backward(stage, m, cotangents.pop((stage, m), None))
        if stage:
            cotangents[stage - 1, m] = primitives.send(
                sent, stage - 1, schedules.BACKWARD
            )
    return primitives.joined(losses, predictions)


def run_forward(primitives, x):
    """The stages' outputs of a batch, one micro-batch after the other,
    without gradients (evaluation, prediction, direct calls).

    Args:
        primitives: the backend's `StagePrimitives`.
        x: the batch's inputs.

    Returns:
        The last stage's outputs of each micro-batch, in order.
    """
    outputs = []
    for tensors in primitives.microbatches(x, None)[0]:
        for stage in range(primitives.num_stages):
            if stage:
                tensors = primitives.send(tensors, stage, schedules.FORWARD)
            tensors = primitives.infer(stage, tensors)
        outputs.append(tensors)
    return outputs
