"""One worker of the TensorFlow multi-worker smoke test.

Trains the test MLP with `TensorParallelKeras` split over the replicas of a
`MultiWorkerMirroredStrategy` (one per worker process) and, in the same
process, the plain model on one device; writes the largest differences as
JSON. `tests/test_tensorflow.py` starts two workers on loopback ports; by
hand, in two shells (ports of your choice):

    export KERAS_BACKEND=tensorflow
    CLUSTER='"cluster": {"worker": ["localhost:12345", "localhost:12346"]}'
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python tests/tf_scripts/multi_worker.py /tmp/worker0.json
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python tests/tf_scripts/multi_worker.py /tmp/worker1.json
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
sys.path.insert(0, ROOT)

# Cross-process collectives must be configured before any TF operation.
from keras_tp.runtime.tensorflow import configure_multi_worker  # noqa: E402

strategy = configure_multi_worker()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tp  # noqa: E402
from tests import models  # noqa: E402


def main(out_path):
    task = strategy.cluster_resolver.task_id
    reference = models.mlp()
    tp = keras_tp.TensorParallelKeras(models.mlp())
    x, y = models.data_for("mlp", batch=20)
    # Worker 1 reads other data on purpose: every rank must still train on
    # worker 0's batches, as the reference does.
    own_x, own_y = models.data_for("mlp", batch=20, seed=1 + task)
    for model, (inputs, targets) in ((reference, (x, y)), (tp, (own_x, own_y))):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(
            inputs, targets, batch_size=4, epochs=1, shuffle=False, verbose=0
        )
    weight_diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(reference.get_weights(), tp.get_weights())
    )
    output_diff = float(
        np.abs(
            reference.predict(x, verbose=0) - tp.predict(own_x, verbose=0)
        ).max()
    )
    result = {
        "task": task,
        "world_size": tp.get_parallelism_info()["world_size"],
        "weight_diff": weight_diff,
        "output_diff": output_diff,
        "parameter_bytes_per_device": tp.parameter_bytes_per_device(),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
