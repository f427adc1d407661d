"""Run on every rank by `keras_tp.launch` in tests/test_torch_async.py.

One launch of 2 workers and 2 servers trains every configuration, because
starting the processes is the slow part. Each rank returns plain numbers;
the oracle of `max_staleness=0` is the same model trained by Keras on one
device, in the same process.
"""

import os
import time

import keras
import numpy as np

import keras_tp
from keras_tp.asynchronous.servers import partition_variables
from tests import async_cases
from tests import models
from tests import mpi_jobs
from tests.torch_scripts.rank_checks import _all_ranks
from tests.torch_scripts.rank_checks import reachable_tensor_bytes

WORKERS = 2
SERVERS = 2
# The rank (a worker) that sleeps in each step of the slow-worker run.
SLOW_RANK = 1
SLOW_SECONDS = 0.05


class SleepOnRank(keras.layers.Layer):
    """Passes its input through; on one rank it first sleeps.

    It stands for a slower machine: torch runs eagerly, so the sleep
    happens in every step of that rank.
    """

    def __init__(self, rank, seconds, **kwargs):
        super().__init__(**kwargs)
        self.rank = rank
        self.seconds = seconds

    def call(self, inputs):
        if int(os.environ.get("RANK", 0)) == self.rank:
            time.sleep(self.seconds)
        return inputs


def _compiled(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=models.loss_fn(),
        metrics=["accuracy"],
    )
    return model


def _synchronous():
    """max_staleness=0 against one device; what this rank holds."""
    x, y = async_cases.data()
    trainer = _compiled(
        keras_tp.AsyncDataParallel(
            mpi_jobs.mlp(), workers=WORKERS, servers=SERVERS, max_staleness=0
        )
    )
    reference = _compiled(mpi_jobs.mlp())
    fit = dict(batch_size=async_cases.BATCH, epochs=2, shuffle=False, verbose=0)
    history = trainer.fit(x, y, **fit)
    reference_history = reference.fit(x, y, **fit)
    result = {
        "weights": models.max_diff(
            trainer.get_weights(), reference.get_weights()
        ),
        "losses": history.history["loss"],
        "reference_losses": reference_history.history["loss"],
        "histograms": history.history["staleness_histogram"],
        "evaluate": [
            trainer.evaluate(x, y, verbose=0),
            reference.evaluate(x, y, verbose=0),
        ],
    }
    role = trainer._runner.role
    if hasattr(role, "bound"):
        variables = trainer.trainable_variables
        held = partition_variables(variables, SERVERS)[role.index]
        result["server"] = {
            "index": role.index,
            "partition_bytes": sum(
                np.asarray(variables[i].value.detach()).nbytes for i in held
            ),
            "model_bytes": sum(
                np.asarray(v.value.detach()).nbytes for v in variables
            ),
            "parameter_bytes": reachable_tensor_bytes(role.variables),
            # Everything the server keeps: parameters, optimizer state.
            "held_bytes": reachable_tensor_bytes(role),
            "optimizer_slot_bytes": sum(
                np.asarray(v.value.detach()).nbytes
                for v in role.optimizer.variables
                if v.shape
            ),
        }
    return result


def _pull_every():
    """max_staleness=0, pull_every=2 on 48 samples: each worker computes
    3 slices, the last pushed without a pull; one device on batches of 32."""
    x, y = async_cases.data()
    x, y = x[:48], y[:48]
    trainer = keras_tp.AsyncDataParallel(
        mpi_jobs.mlp(),
        workers=WORKERS,
        servers=SERVERS,
        max_staleness=0,
        pull_every=2,
    )
    trainer.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn()
    )
    history = trainer.fit(
        x, y, batch_size=async_cases.BATCH, epochs=2, shuffle=False, verbose=0
    )
    reference = mpi_jobs.mlp()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn()
    )
    reference.fit(
        x,
        y,
        batch_size=2 * async_cases.BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    return {
        "weights": models.max_diff(
            trainer.get_weights(), reference.get_weights()
        ),
        "histograms": history.history["staleness_histogram"],
    }


def _slow_worker(max_staleness):
    """A worker sleeping in each step, shuffled batches, validation; what
    every rank ends with."""
    x, y = async_cases.data()
    inputs = keras.Input((16,))
    outputs = mpi_jobs.mlp()(SleepOnRank(SLOW_RANK, SLOW_SECONDS)(inputs))
    trainer = keras_tp.AsyncDataParallel(
        keras.Model(inputs, outputs),
        workers=WORKERS,
        servers=SERVERS,
        max_staleness=max_staleness,
    )
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    history = trainer.fit(
        x, y, batch_size=8, epochs=2, validation_data=(x, y), verbose=0
    )
    return {
        "history": {
            name: values
            for name, values in history.history.items()
            if name != "staleness_histogram"
        },
        "histograms": history.history["staleness_histogram"],
        "weights": [w.tolist() for w in trainer.get_weights()],
    }


def _wrong_world_size():
    trainer = keras_tp.AsyncDataParallel(mpi_jobs.mlp(), workers=2, servers=1)
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    x, y = async_cases.data()
    try:
        trainer.fit(x, y, verbose=0)
    except ValueError as error:
        return str(error)
    return None


def checks(max_staleness):
    """Every configuration on this rank; every rank's results, by rank."""
    return _all_ranks(
        {
            "synchronous": _synchronous(),
            "pull_every": _pull_every(),
            "slow_worker": _slow_worker(max_staleness),
            "wrong_world_size": _wrong_world_size(),
        }
    )
