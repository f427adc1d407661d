"""What the single-controller stage runners (JAX, TensorFlow) share."""

from keras_tp.pipeline import schedules


class ScheduledStages:
    """Stages on devices of their own, issued by one thread in order.

    The JAX and TensorFlow runners issue every stage's actions from one
    Python thread, in `order`: the schedule's actions sorted so that each
    comes after the ones it waits for (`schedules.issue_order`).

    Args:
        stage_models: the Keras model of each stage, in order.
        devices: the device of each stage.
        loss: a function of `(y_true, y_pred)` that averages over the
            micro-batch, for the last stage.
        schedule: `"gpipe"` or `"1f1b"`.
        num_microbatches: micro-batches per batch.
        stats: the `CommunicationStats` that count what the stages send
            each other (axis `"pipe"`).
    """

    def __init__(
        self, stage_models, devices, loss, schedule, num_microbatches, stats
    ):
        schedules.check_schedule_name(schedule)
        if len(devices) != len(stage_models):
            raise ValueError(
                f"{len(stage_models)} stages need as many devices, got "
                f"{len(devices)}."
            )
        self.stage_models = list(stage_models)
        self.devices = list(devices)
        self.loss = loss
        self.num_microbatches = num_microbatches
        self.stats = stats
        self.order = schedules.issue_order(
            schedule, len(stage_models), num_microbatches
        )
