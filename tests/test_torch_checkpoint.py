"""Sharded checkpoints on the PyTorch backend, across layouts and backends.

Run alone:
`KERAS_BACKEND=torch python -m pytest tests/test_torch_checkpoint.py`.
Each rank process writes and reads only its own pieces. A checkpoint that
JAX saved at TP=4 loads on two torch ranks; one that torch ranks saved
under ZeRO-3 loads into a plain Keras model.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402
from keras_tp.checkpoint.files import read_manifest  # noqa: E402
from tests import checkpoint_cases as cases  # noqa: E402
from tests import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "transformer_lm"
LAYOUTS = [(2, 1, 0), (2, 2, 2)]


def _load_at_layouts(directory):
    return [
        cases.load_and_record(cases.parallel(NAME, *mesh), NAME, directory)
        for mesh in LAYOUTS
    ]


def test_jax_checkpoint_loads_on_torch_ranks(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_cases", str(tmp_path), "4"],
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "jax"},
        check=True,
        timeout=400,
    )
    reference = dict(np.load(tmp_path / "record.npz"))
    records = keras_tp.launch(
        _load_at_layouts, world_size=2, args=(str(tmp_path),), timeout=400
    )
    for mesh, record in zip(LAYOUTS, records):
        cases.check_same(
            record,
            reference,
            ("jax -> torch", mesh),
            cases.CROSS_BACKEND_LOSS_TOLERANCE,
        )


def test_zero3_ranks_save_pieces_a_plain_model_loads(tmp_path):
    cases.main(str(tmp_path), 2, 2, 3)
    manifest = read_manifest(str(tmp_path))
    assert sorted(manifest["files"]) == [
        "save1-rank0.safetensors",
        "save1-rank1.safetensors",
    ]
    assert manifest["mesh"]["zero_stage"] == 3
    reference = dict(np.load(tmp_path / "record.npz"))
    plain = cases.compiled(models.BUILDERS[NAME](), NAME)
    cases.check_same(
        cases.load_and_record(plain, NAME, str(tmp_path)),
        reference,
        "torch ZeRO-3 -> plain",
    )


def test_keras_checkpoint_callbacks_on_two_ranks(tmp_path):
    """BackupAndRestore resumes exactly with dropout; ModelCheckpoint's
    last checkpoint loads at another layout. Every rank runs the callbacks."""
    resumed, checkpoints = keras_tp.launch(
        cases.callbacks_on_rank,
        world_size=2,
        args=(str(tmp_path),),
        timeout=400,
    )
    cases.check_resumed(*resumed)
    cases.check_model_checkpoint(*checkpoints)
