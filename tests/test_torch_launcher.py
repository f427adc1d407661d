"""`keras_tp.launch` shares the CPU cores among torch ranks.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_launcher.py`.
"""

import os

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import torch  # noqa: E402

from keras_tp import launcher  # noqa: E402


def test_ranks_outnumbering_the_cores_warn_and_take_one_thread_each(
    monkeypatch,
):
    # Whatever this machine has, pretend it has one core for two ranks.
    monkeypatch.setattr(launcher, "usable_cores", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.warns(UserWarning, match="2 ranks share 1 CPU cores"):
        threads = launcher.launch(
            torch.get_num_threads, world_size=2, timeout=120
        )
    assert threads == 1
    assert "OMP_NUM_THREADS" not in os.environ


def test_threads_per_rank_decides_over_the_cores(monkeypatch):
    # Four cores would give two ranks two threads each.
    monkeypatch.setattr(launcher, "usable_cores", lambda: 4)
    threads = launcher.launch(
        torch.get_num_threads, world_size=2, threads_per_rank=1
    )
    assert threads == 1


def test_the_agent_numbers_the_ranks_over_the_callers_variables(
    monkeypatch,
):
    # The caller's environment reaches the ranks, but for the variables
    # the agent sets: a caller that itself ran under a launcher keeps no
    # say over the ranks' numbers.
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("KERAS_TP_TEST_VARIABLE", "seen")
    assert launcher.launch(_environment_of_rank, world_size=2) == ("0", "seen")


def _environment_of_rank():
    return os.environ["RANK"], os.environ["KERAS_TP_TEST_VARIABLE"]


def test_nproc_per_node_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="nproc_per_node must be an integer"):
        launcher.launch(torch.get_num_threads, world_size=2, nproc_per_node=0)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import keras_tp\n\n"
        "def train():\n"
        "    return 1\n\n"
        "keras_tp.launch(train, world_size=2, timeout=120)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "KERAS_BACKEND": "torch"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert f"The script {script} has no `if __name__" in result.stderr


SLURM_TRAIN = """
import os

import keras
import numpy as np

import keras_tp
from tests import models

tp = keras_tp.TensorParallelKeras(
    models.mlp(), world_size=keras_tp.elastic_world_size(), data_parallel=2
)
tp.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
x, y = models.data_for("mlp", batch=16)
tp.fit(x, y, batch_size=8, epochs=1)
# One file per rank: the ranks share one stdout, where their lines
# may interleave.
world_size = tp.get_parallelism_info()["world_size"]
with open(f"rank{os.environ['RANK']}.txt", "w") as report:
    report.write(f"trained on {world_size} ranks")
"""


def test_the_slurm_recipe_trains_on_one_node(tmp_path):
    # docs/examples/slurm_torch.sbatch's srun command, run as srun runs
    # it on the job's one node: with the variables SLURM sets there.
    import pathlib
    import socket
    import subprocess

    repo = pathlib.Path(__file__).resolve().parents[1]
    recipe = (repo / "docs/examples/slurm_torch.sbatch").read_text()
    command = recipe.replace("\\\n", " ").split("\nsrun ", 1)[1].split("\n")[0]
    (tmp_path / "train.py").write_text(SLURM_TRAIN)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_ON_NODE": "2",
        "head_node": "127.0.0.1",
        "KERAS_BACKEND": "torch",
        "PYTHONPATH": str(repo),
    }
    result = subprocess.run(
        ["bash", "-c", command.replace(":29500", f":{port}")],
        cwd=tmp_path,
        env={**os.environ, **slurm},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    reports = sorted(tmp_path.glob("rank*.txt"))
    assert [r.name for r in reports] == ["rank0.txt", "rank1.txt"]
    assert {r.read_text() for r in reports} == {"trained on 2 ranks"}
    # Rank 0 speaks for the job: one progress bar. Keras shows a bar's
    # first step always, its last once or twice (at the step, if 50 ms
    # have passed since the last display, and when the epoch ends).
    assert result.stdout.count("1/2") == 1, result.stdout
