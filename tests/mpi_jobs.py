"""What the mpirun tests share: the job, and a model its ranks build fast.

`mpirun` runs a test script under Open MPI on loopback. CI installs Open
MPI (`openmpi-bin`, from Debian) and `mpi4py` (`keras_tp[mpi]`) in
`.ci/run`; there (`CI=true`) a missing one fails the test. Elsewhere the
test is skipped with the command that installs it.
"""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL_MPIRUN = "apt-get install -y --no-install-recommends openmpi-bin"
INSTALL_MPI4PY = 'pip install -e ".[mpi]"'
# Every variable of a launcher that would make a rank take its place from
# it rather than from mpirun.
_OTHER_LAUNCHERS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)


def in_ci():
    return os.environ.get("CI", "").lower() in ("true", "1")


def mlp():
    """The MLP of `tests.models.mlp`, seeded by its initializers.

    `models.mlp()` seeds with `keras.utils.set_random_seed`, which imports
    TensorFlow where it is installed: seconds of every rank's start.
    """
    import keras

    def dense(units, name, seed, activation=None):
        return keras.layers.Dense(
            units,
            activation=activation,
            name=name,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        )

    inputs = keras.Input((16,))
    x = dense(32, "up", 1, "relu")(inputs)
    x = dense(32, "down", 2, "relu")(x)
    outputs = dense(8, "head", 3)(x)
    return keras.Model(inputs, outputs, name="mlp")


def require(available, what, install):
    """Skips the test (fails it in CI) when `what` is not installed."""
    import pytest

    if available:
        return
    message = f"needs {what}: {install}"
    if in_ci():
        pytest.fail(f"{message} (.ci/run installs it)")
    pytest.skip(message)


def mpirun(ranks, script, *args, backend, timeout=120):
    """Runs `python script *args` as `ranks` ranks of one mpirun job.

    Args:
        ranks: the number of processes.
        script: a path relative to the repository root.
        *args: the script's arguments.
        backend: the `KERAS_BACKEND` of the ranks.
        timeout: seconds the job may take.

    Returns:
        The job's output (stdout and stderr), once it succeeded.
    """
    require(shutil.which("mpirun"), "Open MPI's mpirun", INSTALL_MPIRUN)
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in _OTHER_LAUNCHERS
    }
    environment.update(
        KERAS_BACKEND=backend,
        PYTHONPATH=ROOT,
        # Two ranks on two cores: one thread each computes fastest.
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    command = [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        # Loopback only: MPI's own messages (mpi4py's) over TCP on `lo`.
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "-n",
        str(ranks),
        sys.executable,
        os.path.join(ROOT, script),
        *map(str, args),
    ]
    result = subprocess.run(
        command,
        env=environment,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout
