"""Sharded checkpoints on the JAX backend: resharding, resume, damage.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_checkpoint.py`.
A checkpoint saved at one layout (tensor-parallel size, data-parallel size,
ZeRO stage, backend, or a plain Keras model) loads at another and computes
what the saved model computed; a save killed midway leaves the previous
checkpoint loadable; a damaged file is named.
"""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import keras_tp

if keras.backend.backend() != "jax":
    pytest.skip(
        "JAX tests; run with KERAS_BACKEND=jax", allow_module_level=True
    )

keras_tp.configure_virtual_devices(4)

from keras_tp.checkpoint.files import read_manifest  # noqa: E402
from tests import checkpoint_cases as cases  # noqa: E402
from tests import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "transformer_lm"


@pytest.fixture(scope="module")
def saved_at_tp4(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp4"))
    record = cases.train_and_save(cases.parallel(NAME, 4), NAME, directory)
    return directory, record


@pytest.mark.parametrize(
    "world_size, data_parallel, zero_stage",
    [(2, 1, 0), (1, 1, 0), (4, 2, 1), (4, 2, 3), (2, 2, 2)],
)
def test_reshards_at_load_and_resumes(
    saved_at_tp4, world_size, data_parallel, zero_stage
):
    directory, reference = saved_at_tp4
    tp = cases.parallel(NAME, world_size, data_parallel, zero_stage)
    record = cases.load_and_record(tp, NAME, directory)
    cases.check_same(record, reference, (world_size, data_parallel, zero_stage))


def test_lost_optimizer_state_shows(saved_at_tp4):
    """The loss check fails when the optimizer state is not restored."""
    directory, reference = saved_at_tp4
    tp = cases.parallel(NAME, 2)
    keras_tp.load_checkpoint(tp, directory)
    for variable in tp.optimizer.variables[2:]:  # Adam's moments
        variable.assign(keras.ops.zeros(variable.shape, variable.dtype))
    record = cases.record_after(tp, NAME)
    losses = np.abs(record["losses"] - reference["losses"]).max()
    assert losses > 10 * cases.CROSS_BACKEND_LOSS_TOLERANCE, losses


def test_plain_keras_model_loads_and_saves(saved_at_tp4, tmp_path):
    directory, reference = saved_at_tp4
    plain = cases.compiled(models.BUILDERS[NAME](), NAME)
    cases.check_same(
        cases.load_and_record(plain, NAME, directory), reference, "plain"
    )
    # And back: a plain model's checkpoint loads split over 4 devices.
    plain = cases.compiled(models.BUILDERS[NAME](), NAME)
    plain_reference = cases.train_and_save(plain, NAME, str(tmp_path))
    tp = cases.parallel(NAME, 4)
    cases.check_same(
        cases.load_and_record(tp, NAME, str(tmp_path)),
        plain_reference,
        "plain -> TP=4",
    )


def test_every_rank_writes_its_own_pieces_once(saved_at_tp4):
    directory, _ = saved_at_tp4
    manifest = read_manifest(directory)
    assert manifest["mesh"]["tensor_parallel"] == 4
    assert sorted(manifest["files"]) == [
        f"save1-cpu{d}.safetensors" for d in range(4)
    ]
    tp = cases.parallel(NAME, 4)
    sizes = {}
    for entry in manifest["variables"]:
        saved = sum(
            int(np.prod([b - a for a, b in p["index"]]))
            for p in entry["pieces"]
        )
        assert saved == int(np.prod(entry["shape"])), entry["path"]
        sizes[entry["path"]] = len(entry["pieces"])
    # A split kernel is saved as 4 pieces, one per device, a replicated
    # variable once.
    axes = tp.sharding_plan.variable_axes()
    for path, (_, axis) in axes.items():
        assert sizes[path] == (4 if axis is not None else 1), path
    bytes_per_file = [f["bytes"] for f in manifest["files"].values()]
    assert max(bytes_per_file) < 0.6 * sum(bytes_per_file)


def test_checkpoint_from_tensorflow_loads_on_jax(tmp_path):
    """TensorFlow saves at TP=2; JAX loads at TP=4 and at TP=2 x DP=2."""
    _save_in_subprocess("tensorflow", tmp_path, 2)
    reference = dict(np.load(tmp_path / "record.npz"))
    for mesh in [(4, 1, 0), (4, 2, 2)]:
        tp = cases.parallel(NAME, *mesh)
        record = cases.load_and_record(tp, NAME, str(tmp_path))
        cases.check_same(
            record,
            reference,
            ("tensorflow -> jax", mesh),
            cases.CROSS_BACKEND_LOSS_TOLERANCE,
        )


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    """SIGKILL while the second save writes: the first still loads."""
    script = (
        "import os, sys, time\n"
        "import keras_tp\n"
        "keras_tp.configure_virtual_devices(2)\n"
        "import numpy as np\n"
        "from keras_tp.checkpoint import files\n"
        "from tests import checkpoint_cases as cases\n"
        "tp = cases.parallel('transformer_lm', 2)\n"
        "record = cases.train_and_save(tp, 'transformer_lm', sys.argv[1])\n"
        "np.savez(os.path.join(sys.argv[1], 'record.npz'), **record)\n"
        "write = files.save_file\n"
        "def slow(pieces, path):\n"
        "    write(pieces, path)\n"
        "    open(sys.argv[1] + '.writing', 'w').close()\n"
        "    time.sleep(60)\n"
        "files.save_file = slow\n"
        "tp.save_checkpoint(sys.argv[1], epoch=2)\n"
    )
    directory = tmp_path / "ckpt"
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(directory)],
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    deadline = time.time() + 240
    while not os.path.exists(f"{directory}.writing"):
        assert process.poll() is None, "the saving process ended early"
        assert time.time() < deadline, "the second save never started"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    leftovers = [n for n in os.listdir(directory) if n.startswith("save2-")]
    assert leftovers, os.listdir(directory)
    reference = dict(np.load(directory / "record.npz"))
    tp = cases.parallel(NAME, 2)
    cases.check_same(
        cases.load_and_record(tp, NAME, str(directory)), reference, "kill"
    )
    # The next save replaces the manifest and removes the files of the
    # first save and of the dead one it does not rewrite.
    manifest = tp.save_checkpoint(str(directory), epoch=3)
    names = set(os.listdir(directory))
    assert names == {"manifest.json", "record.npz", *manifest["files"]}, names


def test_damaged_or_foreign_checkpoints_are_refused(saved_at_tp4, tmp_path):
    directory, _ = saved_at_tp4
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            (copy / name).write_bytes(f.read())
    damaged = copy / "save1-cpu2.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    with pytest.raises(
        keras_tp.CheckpointError, match="save1-cpu2.safetensors"
    ):
        keras_tp.load_checkpoint(cases.parallel(NAME, 2), str(copy))
    with pytest.raises(keras_tp.CheckpointError, match="no manifest.json"):
        keras_tp.load_checkpoint(cases.parallel(NAME, 2), str(tmp_path))
    other = cases.compiled(models.BUILDERS["mlp"](), "mlp")
    with pytest.raises(keras_tp.CheckpointError, match="another architecture"):
        keras_tp.load_checkpoint(other, directory)


def test_paths_that_are_no_checkpoint_are_named(tmp_path):
    tp = cases.parallel("mlp", 2)
    file = tmp_path / "model.weights.h5"
    file.write_bytes(b"")
    with pytest.raises(keras_tp.CheckpointError) as caught:
        tp.save_weights(str(file))
    assert f"'{file}': it is a file" in str(caught.value)
    assert "Pass another path" in str(caught.value)
    missing = tmp_path / "never_saved"
    with pytest.raises(keras_tp.CheckpointError) as caught:
        keras_tp.load_checkpoint(tp, str(missing))
    assert f"'{missing}': the path does not exist" in str(caught.value)
    assert "Check the path" in str(caught.value)


def _save_in_subprocess(backend, directory, world_size, *mesh):
    command = [
        sys.executable,
        "-m",
        "tests.checkpoint_cases",
        str(directory),
        str(world_size),
        *(str(m) for m in mesh),
    ]
    subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": backend},
        check=True,
        timeout=400,
    )


def test_backup_and_restore_resumes_exactly_with_dropout(tmp_path):
    """Per-rank steps (a data axis): every rank draws its own masks."""
    make = cases.with_dropout(4, 2)
    cases.check_resumed(*cases.backup_and_restore_run(make, str(tmp_path)))


def test_model_checkpoint_each_epoch_loads_at_another_layout(tmp_path):
    saved, loaded = cases.model_checkpoint_run(
        cases.with_dropout(2), cases.with_dropout(4, 2, 1), str(tmp_path)
    )
    cases.check_model_checkpoint(saved, loaded)
    assert sorted(os.listdir(tmp_path)) == [
        "epoch1.weights.h5",
        "epoch2.weights.h5",
    ]
    assert read_manifest(str(tmp_path / "epoch2.weights.h5"))["step"] == 12


def test_a_loss_scale_loads_with_its_optimizer_at_any_layout(tmp_path):
    # Saved where a GlobalLossScaleOptimizer wraps a CoordinatedOptimizer
    # (a data axis), loaded where Keras' own wraps Adam (one device, and
    # tensor parallelism alone): the scale and the slots come back.
    scales, differences = cases.loss_scale_round_trip(
        str(tmp_path), (2, 2), [None, (2, 1), (4, 2)]
    )
    assert scales == [256.0] * 3
    assert max(differences) < 1e-3, differences
