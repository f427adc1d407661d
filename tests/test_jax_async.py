"""`AsyncDataParallel` on JAX: worker threads and servers on 4 virtual CPUs.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_async.py`.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

import jax  # noqa: E402

from keras_tp.runtime.jax.asynchronous import DeviceOps  # noqa: E402
from tests import async_cases  # noqa: E402
from tests import models  # noqa: E402


def test_synchronous_matches_one_device():
    async_cases.check_synchronous_matches_one_device(workers=2, servers=2)


def test_pull_every_computes_from_held_parameters():
    async_cases.check_pull_every_accumulates()


def test_staleness_never_exceeds_the_bound(monkeypatch):
    async_cases.check_staleness_bound(monkeypatch, DeviceOps, max_staleness=2)


def test_servers_hold_their_partition_on_their_device():
    runner = async_cases.check_servers_partition(servers=2)
    for server, device in zip(runner.servers, runner.server_devices):
        for value in server.params:
            assert value.devices() == {device}


def test_more_workers_than_devices_is_refused():
    trainer = keras_tp.AsyncDataParallel(models.mlp(), workers=5)
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    x, y = async_cases.data()
    with pytest.raises(ValueError, match="needs a device per worker"):
        trainer.fit(x, y, verbose=0)
    assert len(jax.devices()) == 4


def test_a_dataset_is_refused_with_the_fix():
    import tensorflow as tf

    trainer = keras_tp.AsyncDataParallel(models.mlp(), workers=2)
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    x, y = async_cases.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(TypeError, match="takes x as arrays") as caught:
        trainer.fit(dataset, verbose=0)
    assert "_BatchDataset" in str(caught.value)
    assert "zip(*dataset.as_numpy_iterator())" in str(caught.value)
