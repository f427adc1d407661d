"""`AsyncDataParallel` on TensorFlow: worker threads and servers on 4
logical CPU devices.

Run alone: `KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_async.py`.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.runtime.tensorflow.asynchronous import DeviceOps  # noqa: E402
from tests import async_cases  # noqa: E402


def test_synchronous_matches_one_device():
    async_cases.check_synchronous_matches_one_device(workers=2, servers=1)


def test_pull_every_computes_from_held_parameters():
    async_cases.check_pull_every_accumulates()


def test_staleness_never_exceeds_the_bound(monkeypatch):
    async_cases.check_staleness_bound(monkeypatch, DeviceOps, max_staleness=1)


def test_servers_hold_their_partition_on_their_device():
    runner = async_cases.check_servers_partition(servers=2)
    for server, device in zip(runner.servers, runner.server_devices):
        for variable in server._store._variables:
            spec = tf.DeviceSpec.from_string(variable.value.device)
            assert f"{spec.device_type.lower()}:{spec.device_index}" == device
