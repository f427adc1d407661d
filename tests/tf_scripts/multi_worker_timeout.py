"""One worker of the TensorFlow dead-worker test.

Trains the test MLP with `TensorParallelKeras` over a
`MultiWorkerMirroredStrategy` built with a collective timeout. Worker
`VICTIM` fails after its fifth step (`HOW`: "kill" is SIGKILL, "freeze" is
SIGSTOP, "sleep" keeps the process alive, heartbeats and all, but sleeps
in a callback for three collective timeouts), writing the time to
`OUT_DIR/failed.json` first; the surviving worker must end with a
`keras_tp.RankLostError` (or `RankStuckError`, for "sleep") naming it, and
writes the time it ended to `OUT_DIR/ended<task>.json`.
`tests/test_tensorflow_multiworker_timeout.py` starts two workers on
loopback ports; by hand, in two shells (ports of your choice):

    export KERAS_BACKEND=tensorflow
    CLUSTER='"cluster": {"worker": ["localhost:12345", "localhost:12346"]}'
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 0}}" \\
        python tests/tf_scripts/multi_worker_timeout.py /tmp/out 10 1 kill
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 1}}" \\
        python tests/tf_scripts/multi_worker_timeout.py /tmp/out 10 1 kill
"""

import atexit
import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
sys.path.insert(0, ROOT)

# Cross-process collectives must be configured before any TF operation.
from keras_tp.runtime.tensorflow import configure_multi_worker  # noqa: E402

OUT, TIMEOUT, VICTIM, HOW = sys.argv[1:5]
strategy = configure_multi_worker(collective_timeout=float(TIMEOUT))

import keras  # noqa: E402

import keras_tp  # noqa: E402
from tests import models  # noqa: E402

TASK = strategy.cluster_resolver.task_id


def _write_json(path, value):
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


class FailAfterFiveSteps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if TASK == int(VICTIM) and batch == 4:
            _write_json(
                os.path.join(OUT, "failed.json"),
                {"time": time.time(), "pid": os.getpid()},
            )
            if HOW == "sleep":
                time.sleep(3 * float(TIMEOUT))
            else:
                os.kill(
                    os.getpid(),
                    signal.SIGKILL if HOW == "kill" else signal.SIGSTOP,
                )


if __name__ == "__main__":
    # After the uncaught error, if any, has been shown.
    atexit.register(
        lambda: _write_json(
            os.path.join(OUT, f"ended{TASK}.json"), {"time": time.time()}
        )
    )
    tp = keras_tp.TensorParallelKeras(models.mlp())
    x, y = models.data_for("mlp", batch=400)
    tp.compile(optimizer="adam", loss=models.loss_fn())
    tp.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[FailAfterFiveSteps()],
    )
