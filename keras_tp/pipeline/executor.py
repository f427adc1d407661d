"""The one executor of a pipeline schedule: as torch's
`_PipelineScheduleRuntime`, it runs a list of `Action`s alike on every
backend, over its `StagePrimitives`: one process issues every stage's
actions (JAX, TensorFlow), or each rank its own stage's (torch)."""

import functools

import keras

from keras_tp.parallel.batch_loss import fraction_scale
from keras_tp.pipeline import schedules
from keras_tp.pipeline.schedules import FORWARD
from keras_tp.tensors import concatenated
from keras_tp.tensors import nbytes
from keras_tp.tensors import scaled
from keras_tp.tensors import with_masks


class StagePrimitives:
    """What a backend supplies: the passes of stage `stage` on micro-batch
    `m` of a `PipelineRuntime`'s step, which the executor orders and
    routes values between (`send` counts them in the pipeline's `stats`).
    """

    # Per stage and micro-batch whose layers added losses (but the last
    # stage's, in its loss share), what each of its devices added, as
    # `send` takes it: `forward` and `infer` fill it.
    added = ()
    # What masked predictions multiply the gradients by (`joined_loss`).
    gradient_scale = None
    # The data-parallel rows each micro-batch holds a slice of.
    replicas = 1

    def __init__(self, pipeline, num_microbatches):
        self.pipeline = pipeline
        self.stats = pipeline.stats
        self.num_stages = pipeline.pipeline_parallel
        self.num_microbatches = num_microbatches

    @functools.cached_property
    def order(self):
        """Every stage's actions of a training step, in the order one
        process issues them (`schedules.issue_order`)."""
        return schedules.issue_order(
            self.pipeline.schedule, self.num_stages, self.num_microbatches
        )

    def split(self, tree):
        """Per micro-batch, its part of the batch `tree`: the `m`-th slice
        of each of the batch's `replicas` rows, row by row."""
        rows = split_rows(tree, self.replicas, self.num_microbatches)
        return [concatenated(micro) for micro in rows]

    def forward(self, stage, m, inputs, target):
        """The training forward pass (the last stage's with `target`):
        `(what it sends on, or the last stage's loss share; the last
        stage's outputs, else None)`."""
        raise NotImplementedError

    def backward(self, stage, m, cotangent):
        """The backward pass from its outputs' gradients (`None` on the
        last stage): adds to the stage's gradients, returns its inputs'."""
        raise NotImplementedError

    def send(self, value, stage, direction):
        """`value` moved to `stage`'s devices and counted in `stats`;
        `None` where `stage` runs in another process, which `receive`s it.
        """
        for tensor in keras.tree.flatten(value):
            self.stats.record("send", nbytes(tensor), direction, "pipe")
        return value

    def receive(self, stage, m, direction):
        """What another process sent `stage` for this pass; `None` where
        nothing comes, as where one process runs every stage."""
        return None

    def infer(self, stage, inputs):
        """The forward pass without gradients (`None` where another process
        runs `stage`); the last stage's `(outputs, carried_masks(outputs))`,
        as outputs leave a compiled program without their Keras masks."""
        raise NotImplementedError

    def joined(self, losses, predictions):
        """`(loss, y_pred)` of the batch from its micro-batches' loss shares
        (none without targets) and outputs."""
        raise NotImplementedError

    def scaled_gradients(self):
        """`gradients` (by stage, or by stage and replica), times
        `gradient_scale` where set, on each stage's devices (`placed`)."""
        if self.gradient_scale is None:
            return self.gradients
        return {
            key: scaled(grads, self.placed(self.gradient_scale, key))
            for key, grads in self.gradients.items()
        }

    def placed(self, value, key):
        """`value` on the devices of `gradients[key]`'s stage."""
        return value

    def joined_loss(self, shares, replicas):
        """The batch's loss from each micro-batch's (and replica's) `(loss
        share, fraction)`: their sum over the `replicas`, plus
        `added_loss`, times the `gradient_scale` it sets."""
        loss = sum(keras.ops.sum(share) for share, _ in shares) / replicas
        if self.added:
            loss = loss + self.added_loss()
        self.gradient_scale = fraction_scale([f for _, f in shares])
        if self.gradient_scale is not None:
            loss = loss * self.gradient_scale
        return loss

    def added_loss(self):
        """The batch's share of the losses in `added`, on the last stage's
        devices: the micro-batches' means over the devices, averaged;
        `None` without any."""
        if not self.added:
            return None
        total = None
        for added in self.added:
            sent = self.send(added, self.num_stages - 1, FORWARD)
            mean = keras.ops.mean(keras.ops.stack(keras.tree.flatten(sent)))
            total = mean if total is None else total + mean
        return total / self.num_microbatches


def run_schedule(primitives, order, x, y, infer=False):
    """Runs one batch's passes through `primitives` in the `order` of the
    actions, leaving the gradients there (with `infer`, forward passes
    only); returns `primitives.joined`'s."""
    last = primitives.num_stages - 1
    # Per micro-batch, the first stage's inputs and the last's targets.
    inputs = primitives.split(x)
    targets = None if y is None else primitives.split(y)
    # What a stage of this process sent, by the action that takes it.
    held = {(0, FORWARD, m): part for m, part in enumerate(inputs)}
    losses, predictions = [], [None] * len(inputs)
    for stage, kind, m in order:
        taken = held.pop((stage, kind, m), None)
        if taken is None:
            taken = primitives.receive(stage, m, kind)
        if kind == FORWARD:
            if infer:
                outputs = predicted = primitives.infer(stage, taken)
            else:
                target = targets[m] if stage == last else None
                outputs, predicted = primitives.forward(stage, m, taken, target)
            if stage < last:
                held[stage + 1, kind, m] = primitives.send(
                    outputs, stage + 1, kind
                )
            else:
                predictions[m] = predicted
                if not infer:
                    losses.append(outputs)
            continue
        sent = primitives.backward(stage, m, taken)
        if stage:
            held[stage - 1, kind, m] = primitives.send(sent, stage - 1, kind)
    return primitives.joined(losses, predictions)


def run_forward(primitives, x):
    """The outputs of `x`, with their Keras masks, from the forward passes
    alone; `None` in a process without the last stage."""
    order = [
        schedules.Action(stage, FORWARD, m)
        for m in range(primitives.num_microbatches)
        for stage in range(primitives.num_stages)
    ]
    joined = run_schedule(primitives, order, x, None, infer=True)[1]
    return None if joined is None else with_masks(*joined)


def split_rows(x, rows, count):
    """The batch `x` cut into `rows` equal data-parallel rows, each cut
    into `count` equal micro-batches: per micro-batch, per row."""
    size = keras.tree.flatten(x)[0].shape[0] // (rows * count)

    def part(row, m):
        start = (row * count + m) * size
        return keras.tree.map_structure(lambda a: a[start : start + size], x)

    return [[part(row, m) for row in range(rows)] for m in range(count)]


def join_rows(parts):
    """The batch whose `split_rows` are `parts` (per micro-batch, per
    row): row by row, each row's micro-batches in order."""
    return concatenated(
        [micro[row] for row in range(len(parts[0])) for micro in parts]
    )
