"""One worker of the TensorFlow multi-worker smoke test.

Trains the test MLP with `TensorParallelKeras` split over the replicas of a
`MultiWorkerMirroredStrategy` (one per worker process) and, in the same
process, the plain model on one device; writes the largest differences as
JSON. Both save a sharded checkpoint to a directory beside the output
and read it back. `tests/test_tensorflow.py` starts two workers on
loopback ports; by hand, in two shells (ports of your choice):

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
from tests import speaker_cases  # noqa: E402


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
    # Each worker writes its replica's pieces to the shared directory; the
    # chief writes the manifest once both have. A plain model and the
    # split one then read it back.
    directory = os.path.join(os.path.dirname(out_path), "checkpoint")
    manifest = keras_tp.save_checkpoint(tp, directory, epoch=1)
    plain = models.mlp(seed=5)
    keras_tp.load_checkpoint(plain, directory)
    trained = tp.get_weights()
    tp.set_weights([np.zeros_like(w) for w in trained])
    keras_tp.load_checkpoint(tp, directory)
    result = {
        "checkpoint_files": sorted(manifest["files"]),
        "checkpoint_plain_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(plain.get_weights(), trained)
        ),
        "checkpoint_reload_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(tp.get_weights(), trained)
        ),
        "task": task,
        "world_size": tp.get_parallelism_info()["world_size"],
        "weight_diff": weight_diff,
        "output_diff": output_diff,
        "parameter_bytes_per_device": tp.parameter_bytes_per_device(),
    }
    result["one_speaker"] = speaker_cases.one_speaker(
        os.path.dirname(out_path), task
    )
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
