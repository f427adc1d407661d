"""Run on every rank by `keras_tp.launch` in tests/test_torch_pipeline.py."""

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.runtime.torch.pipeline import TorchPipeline
from keras_tp.runtime.torch.process_group import join_process_group
from keras_tp.stats import CommunicationStats
from tests import models

BATCH = 8
STEPS = 3
MICROBATCHES = 4


def _stages(model):
    """The test MLP as 2 stages of its own layers: `up`, then the rest."""
    first = keras.Input((16,))
    second = keras.Input((32,))
    head = model.get_layer("head")(model.get_layer("down")(second))
    return [
        keras.Model(first, model.get_layer("up")(first)),
        keras.Model(second, head),
    ]


def pipeline_run(schedule):
    """Trains the MLP as a 2-stage pipeline and on one device.

    Returns:
        This rank's largest weight difference to one device, the losses
        (last stage), its timeline, its parameter bytes and what it sent.
    """
    join_process_group(2)
    rank = dist.get_rank()
    reference = models.mlp()
    model = models.mlp()
    stage_model = _stages(model)[rank]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = models.data_for("mlp", batch=BATCH * STEPS)
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = reference.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0
    ).history
    stats = CommunicationStats()
    pipeline = TorchPipeline(
        stage_model,
        rank,
        2,
        MICROBATCHES,
        schedule,
        loss,
        stats,
        torch.device("cpu"),
    )
    optimizer = keras.optimizers.Adam(1e-2)
    variables = stage_model.trainable_variables
    losses = []
    timelines = []
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        for variable in variables:
            variable.value.grad = None
        with stats.recording("train"):
            mean_loss, _ = pipeline.step(
                torch.as_tensor(x[batch]), torch.as_tensor(y[batch])
            )
        if mean_loss is not None:
            losses.append(float(mean_loss))
        optimizer.apply([v.value.grad for v in variables], variables)
        timelines.append(pipeline.stage.timeline)
    expected = {
        v.path: np.asarray(w)
        for v, w in zip(reference.weights, reference.get_weights())
    }
    difference = max(
        float(np.max(np.abs(v.numpy() - expected[v.path]))) for v in variables
    )
    return {
        "rank": rank,
        "weights": difference,
        "losses": losses,
        "reference_losses": history["loss"],
        "timelines": timelines,
        "parameter_bytes": sum(v.numpy().nbytes for v in variables),
        "sent": stats.summary(axis="pipe"),
    }


def all_ranks(schedule):
    result = pipeline_run(schedule)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered
