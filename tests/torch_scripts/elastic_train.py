"""Training that survives a lost rank: it resumes from its last checkpoint.

`train(directory)` trains the test MLP step by step with SGD, saving the
weights after every step (all-gathered, rank 0 writes them with NumPy)
and, on rank 0, the losses so far. On the first attempt only, rank 1
fails before step `fail_at` (`how`: "kill" is SIGKILL, "freeze" is
SIGSTOP, "hang" stops its heartbeat and sleeps, as a process stuck in
native code holding Python's lock would, "sleep" only sleeps, as a rank
stuck in a hung data loader would). A restarted attempt runs at
`keras_tp.elastic_world_size()` and loads the last save. Under
`keras_tp.launch(train, ..., max_restarts=1)` (tests/test_torch_elastic.py)
or under torchrun:

    PYTHONPATH=. KERAS_BACKEND=torch KERAS_TP_COLLECTIVE_TIMEOUT=10 \\
        torchrun --nnodes=1:1 --nproc-per-node 2 --max-restarts 1 \\
        tests/torch_scripts/elastic_train.py OUT_DIR hang

The failing rank writes `failed.json` with the time it failed, a rank
whose step raised writes `raised<rank>.json`, and under torchrun each
attempt's rank 0 writes `attempt<k>.json` with the time it ended (after its
uncaught error was shown), so the tests measure how long the survivor
took.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np

import keras_tp
from tests import models

STEPS = 8
BATCH = 8


def train(directory, fail_at=None, how="kill"):
    """Trains `STEPS` steps from the last checkpoint in `directory`.

    Args:
        directory: where the checkpoint and the losses live.
        fail_at: the step before which rank 1 fails on the first attempt.
        how: "kill" (SIGKILL), "freeze" (SIGSTOP), "hang" or "sleep".

    Returns:
        `[{"step", "loss", "world_size", "restart"}]` of every step, the
        ones done before a restart included.
    """
    checkpoint = os.path.join(directory, "checkpoint")
    rank = int(os.environ["RANK"])
    restart = keras_tp.restart_count()
    world_size = keras_tp.elastic_world_size()
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=world_size)
    tp.compile(optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn())
    done = _load(tp, checkpoint)
    losses = [r for r in _read_losses(directory) if r["step"] < done]
    x, y = models.data_for("mlp", batch=STEPS * BATCH)
    for step in range(done, STEPS):
        if step == fail_at and restart == 0 and rank == 1:
            _fail(directory, how)
        batch = slice(step * BATCH, (step + 1) * BATCH)
        try:
            loss = tp.train_on_batch(x[batch], y[batch])
        except Exception:
            # When the survivor's collective gave up, before keras_tp
            # looks for the lost rank.
            _write_json(
                os.path.join(directory, f"raised{rank}.json"),
                {"time": time.time()},
            )
            raise
        losses.append(
            {
                "step": step,
                "loss": float(loss),
                "world_size": world_size,
                "restart": restart,
            }
        )
        _save(tp, checkpoint, step + 1)
        if rank == 0:
            _write_json(os.path.join(directory, "losses.json"), losses)
    return losses


def reference_losses():
    """The losses of the same steps on one device, never interrupted."""
    model = models.mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn())
    x, y = models.data_for("mlp", batch=STEPS * BATCH)
    return [
        float(
            model.train_on_batch(
                x[step * BATCH : (step + 1) * BATCH],
                y[step * BATCH : (step + 1) * BATCH],
            )
        )
        for step in range(STEPS)
    ]


def _save(tp, checkpoint, steps_done):
    """Saves the full weights and the step count, atomically, on rank 0.

    SGD keeps no state but the step count, so the weights and the count
    are all a restart needs to continue exactly.
    """
    weights = tp.get_weights()  # a collective: every rank calls it
    if os.environ["RANK"] == "0":
        arrays = {f"w{i}": w for i, w in enumerate(weights)}
        np.savez(checkpoint + ".tmp.npz", steps_done=steps_done, **arrays)
        os.replace(checkpoint + ".tmp.npz", checkpoint + ".npz")


def _load(tp, checkpoint):
    """Loads the last save into `tp`; returns the number of steps done."""
    if not os.path.exists(checkpoint + ".npz"):
        return 0
    with np.load(checkpoint + ".npz") as saved:
        count = len(saved.files) - 1
        tp.set_weights([saved[f"w{i}"] for i in range(count)])
        steps_done = int(saved["steps_done"])
    tp.optimizer.iterations.assign(steps_done)
    return steps_done


def _fail(directory, how):
    _write_json(
        os.path.join(directory, "failed.json"),
        {"time": time.time(), "pid": os.getpid(), "how": how},
    )
    if how in ("hang", "sleep"):
        if how == "hang":
            from keras_tp.runtime.torch import liveness

            liveness.stop_watching()
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _read_losses(directory):
    path = os.path.join(directory, "losses.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _write_json(path, value):
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    out, how = sys.argv[1], sys.argv[2]
    attempt = os.path.join(out, f"attempt{keras_tp.restart_count()}.json")
    if os.environ["RANK"] == "0":
        import atexit

        # After the uncaught error, if any, has been shown.
        atexit.register(lambda: _write_json(attempt, {"ended": time.time()}))
    train(out, fail_at=3, how=how)
