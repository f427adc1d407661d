"""A training script for `torchrun`: the user code of the README, unchanged.

    PYTHONPATH=. torchrun --standalone --nproc-per-node 2 \
        tests/torch_scripts/train_smoke.py OUT.json

Rank 0 writes the per-epoch losses to OUT.json; tests/test_torch.py compares
them with the same model trained on one device.
"""

import json
import os
import sys

import keras

import keras_tp
from tests import models

EPOCHS = 2


def train(model):
    """Compiles and fits `model` on the MLP data; returns the epoch losses."""
    x, y = models.data_for("mlp")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(
        x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return history.history["loss"]


if __name__ == "__main__":
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    losses = train(tp)
    if os.environ["RANK"] == "0":
        with open(sys.argv[1], "w") as f:
            json.dump({"losses": losses, "info": tp.get_parallelism_info()}, f)
