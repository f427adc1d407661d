"""Sharded checkpoints on the TensorFlow backend, across layouts and backends.

Run alone:
`KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow_checkpoint.py`.
Each replica's pieces are written to a file of its own. A checkpoint that
two torch ranks saved loads on 4 replicas; one the replicas saved under
ZeRO-1 loads into a plain Keras model.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.checkpoint.files import read_manifest  # noqa: E402
from tests import checkpoint_cases as cases  # noqa: E402
from tests import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "transformer_lm"


def test_torch_checkpoint_loads_on_tensorflow_replicas(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_cases", str(tmp_path), "2"],
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "torch"},
        check=True,
        timeout=400,
    )
    reference = dict(np.load(tmp_path / "record.npz"))
    # 2 replicas of 2-way tensor parallelism, each holding its ZeRO-3
    # partition: both splits at once.
    tp = cases.parallel(NAME, 4, 2, 3)
    cases.check_same(
        cases.load_and_record(tp, NAME, str(tmp_path)),
        reference,
        "torch -> tensorflow",
        cases.CROSS_BACKEND_LOSS_TOLERANCE,
    )


def test_replicas_save_pieces_a_plain_model_loads(tmp_path):
    tp = cases.parallel(NAME, 4, 2, 1)
    reference = cases.train_and_save(tp, NAME, str(tmp_path))
    manifest = read_manifest(str(tmp_path))
    assert sorted(manifest["files"]) == [
        f"save1-replica{r}.safetensors" for r in range(4)
    ]
    plain = cases.compiled(models.BUILDERS[NAME](), NAME)
    # The saved run goes on averaging two replicas' gradients, in an order
    # TensorFlow's all-reduce does not fix from run to run; Adam amplifies
    # that rounding as it does another backend's (6e-5 seen).
    cases.check_same(
        cases.load_and_record(plain, NAME, str(tmp_path)),
        reference,
        "tensorflow ZeRO-1 -> plain",
        cases.CROSS_BACKEND_LOSS_TOLERANCE,
    )


def test_backup_and_restore_resumes_exactly_with_dropout(tmp_path):
    make = cases.with_dropout(4, 2)
    cases.check_resumed(*cases.backup_and_restore_run(make, str(tmp_path)))


def test_model_checkpoint_each_epoch_loads_at_another_layout(tmp_path):
    saved, loaded = cases.model_checkpoint_run(
        cases.with_dropout(2), cases.with_dropout(4, 2, 1), str(tmp_path)
    )
    cases.check_model_checkpoint(saved, loaded)
