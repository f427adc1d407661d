"""Run on every rank by `keras_tp.launch` in tests/test_torch_pipeline.py.

Each rank runs its stage of `tests/pipeline_cases.py`'s models through
`TorchPipeline` and checks its weights against one device itself.
"""

import torch
import torch.distributed as dist

from keras_tp.runtime.torch.pipeline import TorchPipeline
from keras_tp.runtime.torch.process_group import join_process_group
from keras_tp.stats import CommunicationStats
from tests import pipeline_cases
from tests.pipeline_cases import MICROBATCHES
from tests.pipeline_cases import STEPS


def _train(stage_model, loss, x, y, schedule, steps):
    """Trains this rank's stage with Adam; returns losses, timelines and
    what it sent."""
    import keras

    rank = dist.get_rank()
    stats = CommunicationStats()
    pipeline = TorchPipeline(
        stage_model,
        rank,
        dist.get_world_size(),
        MICROBATCHES,
        schedule,
        loss,
        stats,
        torch.device("cpu"),
    )
    optimizer = keras.optimizers.Adam(1e-2)
    variables = stage_model.trainable_variables
    losses, timelines = [], []
    for x_batch, y_batch in pipeline_cases.batches(x, y, steps):
        for variable in variables:
            variable.value.grad = None
        with stats.recording("train"):
            mean_loss, _ = pipeline.step(
                keras.tree.map_structure(torch.as_tensor, x_batch),
                torch.as_tensor(y_batch),
            )
        if mean_loss is not None:
            losses.append(float(mean_loss))
        optimizer.apply([v.value.grad for v in variables], variables)
        timelines.append(pipeline.stage.timeline)
    return losses, timelines, stats.summary(axis="pipe")


def _gathered(result):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def all_runs():
    """`mlp_run` of each schedule and `backbone_run`, in one launch
    (starting the ranks is the slow part); every rank's results."""
    join_process_group(2)
    return {
        "gpipe": mlp_run("gpipe"),
        "1f1b": mlp_run("1f1b"),
        "backbone": backbone_run(),
    }


def mlp_run(schedule):
    """Trains the MLP as a 2-stage pipeline; every rank's results."""
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    stage_model = pipeline_cases.mlp_stages()[dist.get_rank()]
    losses, timelines, sent = _train(stage_model, loss, x, y, schedule, STEPS)
    pipeline_cases.check_weights(reference, [stage_model])
    return _gathered(
        {
            "losses": losses,
            "logged": logged,
            "timelines": timelines,
            "parameter_bytes": sum(
                v.numpy().nbytes for v in stage_model.trainable_variables
            ),
            "sent": sent,
        }
    )


def backbone_run():
    """Trains GPT2's backbone as 2 stages (1F1B); every rank's results."""
    loss, reference, split, x, y = pipeline_cases.backbone_reference()
    stage_model = split.stages[dist.get_rank()].model
    _, _, sent = _train(stage_model, loss, x, y, "1f1b", 2)
    pipeline_cases.check_weights(reference, [stage_model])
    return _gathered({"sent": sent})
