"""`AsyncDataParallel` checks shared by the JAX and TensorFlow tests.

Workers are threads on virtual devices of the test process. The oracle of
`max_staleness=0` is the same model trained by Keras on one device, on the
whole global batch: each update averages one slice of each worker.
"""

import time

import keras
import numpy as np

import keras_tp
from tests import models

BATCH = 16
SAMPLES = 64


def data():
    return models.data_for("mlp", batch=SAMPLES)


def trained_pair(workers, servers, epochs=2):
    """`(trainer, history, reference)` after `epochs` with max_staleness=0."""
    x, y = data()
    model = models.mlp()
    trainer = keras_tp.AsyncDataParallel(
        model, workers=workers, servers=servers, max_staleness=0
    )
    trainer.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=models.loss_fn(),
        metrics=["accuracy"],
    )
    history = trainer.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0
    )
    reference = models.mlp()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=models.loss_fn(),
        metrics=["accuracy"],
    )
    reference_history = reference.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0
    )
    return trainer, history, reference, reference_history


def check_synchronous_matches_one_device(workers, servers):
    trainer, history, reference, reference_history = trained_pair(
        workers, servers
    )
    assert (
        models.max_diff(trainer.get_weights(), reference.get_weights()) < 1e-5
    )
    np.testing.assert_allclose(
        history.history["loss"], reference_history.history["loss"], rtol=1e-5
    )
    updates = SAMPLES // BATCH
    assert (
        history.history["staleness_histogram"] == [{0: updates * workers}] * 2
    )
    x, y = data()
    np.testing.assert_allclose(
        trainer.evaluate(x, y, verbose=0),
        reference.evaluate(x, y, verbose=0),
        rtol=1e-5,
    )


def slow_worker(ops_class, slow_device_index, seconds):
    """Patches `ops_class.gradient_function`: one worker sleeps per step.

    The sleep stands for a slower machine; it runs in the worker's thread
    between its steps, as a slow device would keep it.
    """
    original = ops_class.gradient_function

    def gradient_function(self, model):
        step = original(self, model)
        slow = self.devices(None)[slow_device_index]

        def slowed(device, *args):
            if device == slow:
                time.sleep(seconds)
            return step(device, *args)

        return slowed

    return gradient_function


def check_staleness_bound(monkeypatch, ops_class, max_staleness):
    """3 workers, worker 2 slow: no gradient is later than the bound."""
    monkeypatch.setattr(
        ops_class, "gradient_function", slow_worker(ops_class, 2, 0.05)
    )
    x, y = data()
    trainer = keras_tp.AsyncDataParallel(
        models.mlp(), workers=3, servers=1, max_staleness=max_staleness
    )
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    history = trainer.fit(x, y, batch_size=6, epochs=2, verbose=0)
    histograms = history.history["staleness_histogram"]
    seen = {k for h in histograms for k in h}
    assert max(seen) <= max_staleness
    # The fast workers did run ahead of the slow one, up to the bound.
    assert max(seen) == max_staleness
    assert history.history["staleness_max"] == [
        float(max(h)) for h in histograms
    ]
    # Every sample was applied once per epoch.
    per_epoch = -(-SAMPLES // 6) * 3 - _empty_slices(SAMPLES, 6, 3)
    assert [sum(h.values()) for h in histograms] == [per_epoch] * 2
    return trainer


def _empty_slices(samples, batch, workers):
    last = samples % batch
    return max(0, workers - last) if last else 0


def check_servers_partition(servers):
    """Each server holds whole variables, balanced by bytes, on a device
    of its own after the workers'."""
    trainer, *_ = trained_pair(workers=2, servers=servers, epochs=1)
    runner = trainer._runner
    variables = trainer.trainable_variables
    held = sorted(i for server in runner.servers for i in server.indices)
    assert held == list(range(len(variables)))
    nbytes = [
        sum(np.asarray(p).nbytes for p in server.params)
        for server in runner.servers
    ]
    total = sum(np.asarray(v.value).nbytes for v in variables)
    assert sum(nbytes) == total
    largest = max(np.asarray(v.value).nbytes for v in variables)
    assert max(nbytes) - min(nbytes) <= largest
    assert len(set(map(str, runner.server_devices))) == servers
    assert not set(map(str, runner.server_devices)) & set(
        map(str, runner.worker_devices)
    )
    return runner


def check_pull_every_accumulates():
    """`max_staleness=0, pull_every=2`: each worker computes two slices
    from the same parameters, and the update averages all four: one-device
    training on batches twice as large."""
    x, y = data()
    trainer = keras_tp.AsyncDataParallel(
        models.mlp(), workers=2, max_staleness=0, pull_every=2
    )
    trainer.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn()
    )
    history = trainer.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    )
    reference = models.mlp()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=models.loss_fn()
    )
    reference.fit(
        x, y, batch_size=2 * BATCH, epochs=2, shuffle=False, verbose=0
    )
    assert (
        models.max_diff(trainer.get_weights(), reference.get_weights()) < 1e-5
    )
    # Both gradients of each pull are computed from the version that the
    # update applies to.
    assert history.history["staleness_histogram"] == [{0: 8}] * 2
