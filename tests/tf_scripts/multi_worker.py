"""One worker of the TensorFlow multi-worker smoke test.

Trains the test MLP with `TensorParallelKeras` split over the replicas of a
`MultiWorkerMirroredStrategy` (one per worker process) and, in the same
process, the plain model on one device; writes the largest differences as
JSON. Both save a sharded checkpoint to a directory beside the output
and read it back; then Llama's LM trains with sequence parallelism
(`zoo_cases.sequence_parallel_results`). `tests/test_tensorflow.py`
starts two workers on loopback ports; by hand, in two shells (ports of
your choice):

    export KERAS_BACKEND=tensorflow
    CLUSTER='"cluster": {"worker": ["localhost:12345", "localhost:12346"]}'
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
        python tests/tf_scripts/multi_worker.py /tmp/worker0.json 0,1,3
    TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
        python tests/tf_scripts/multi_worker.py /tmp/worker1.json 0,1,3

Then, in the same processes (starting workers takes longer than any of
this), it trains with data_parallel=2 and each of the ZeRO stages of the
second argument: each worker is one data-parallel row and reads only its
half of each global batch, from a `tf.data.Dataset` whose other half is
poisoned (NaN inputs, out-of-range labels); then
`dp_cases.global_batch_losses` with data_parallel=2, and
`dp_cases.local_sgd_runs`. The JSON holds `{"tensor_parallel": ...,
"data_parallel": ...}`.
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
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402
from tests import dp_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import speaker_cases  # noqa: E402
from tests import zoo_cases  # noqa: E402

BATCH = 4


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def _differences(reference, tp, x, own_x):
    """The largest differences of the weights, and of the predictions of
    `x` (the reference's) and `own_x` (this worker's input)."""
    weight_diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(reference.get_weights(), tp.get_weights())
    )
    output_diff = float(
        np.abs(
            reference.predict(x, verbose=0) - tp.predict(own_x, verbose=0)
        ).max()
    )
    return {"weight_diff": weight_diff, "output_diff": output_diff}


def _trained_reference(x, y):
    reference = models.mlp()
    _compile(reference)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return reference


def _checkpoint_round_trip(tp, out_path, name="checkpoint"):
    """Each worker writes its replicas' pieces to the shared directory
    `name`; the chief writes the manifest once all have. A plain model and
    the split one then read it back."""
    directory = os.path.join(os.path.dirname(out_path), name)
    manifest = keras_tp.save_checkpoint(tp, directory, epoch=1)
    plain = models.mlp(seed=5)
    keras_tp.load_checkpoint(plain, directory)
    trained = tp.get_weights()
    tp.set_weights([np.zeros_like(w) for w in trained])
    keras_tp.load_checkpoint(tp, directory)
    return {
        "checkpoint_files": sorted(manifest["files"]),
        "checkpoint_plain_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(plain.get_weights(), trained)
        ),
        "checkpoint_reload_diff": max(
            float(np.abs(a - b).max())
            for a, b in zip(tp.get_weights(), trained)
        ),
    }


def data_parallel(out_path, zero_stages):
    """Worker `task` is data-parallel row `task`: trains a model for each
    of `zero_stages` (one after the other, as every worker builds them) on
    the rows of each global batch of `BATCH` that are its half, and
    compares with the plain model on one device; then the losses of
    `dp_cases.global_batch_losses`, on whole NumPy batches, and local SGD
    and DiLoCo."""
    x, y = models.data_for("mlp", batch=20)
    reference = _trained_reference(x, y)
    result = {
        str(stage): _rows_run(out_path, stage, reference, x, y)
        for stage in zero_stages
    }
    result["losses"] = dp_cases.global_batch_losses(2, 2)
    # Local SGD and DiLoCo, each worker a replica: between
    # synchronisations the workers' replicas differ, and the consistency
    # check compares them across the workers.
    result["local_sgd"] = dp_cases.local_sgd_runs()
    return result


def _rows_run(out_path, zero_stage, reference, x, y):
    task = strategy.cluster_resolver.task_id
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), data_parallel=2, zero_stage=zero_stage
    )
    _compile(tp)
    # The other row's half of every batch is poisoned: it must never be
    # read here.
    other = (np.arange(len(x)) % BATCH) // (BATCH // 2) != task
    own_x = np.where(other[:, None], np.nan, x).astype(x.dtype)
    own_y = np.where(other, 1000, y).astype(y.dtype)
    dataset = tf.data.Dataset.from_tensor_slices((own_x, own_y))
    history = tp.fit(dataset.batch(BATCH, drop_remainder=True), verbose=0)
    result = {
        "task": task,
        "loss": history.history["loss"][0],
        "reference_loss": reference.history.history["loss"][0],
    }
    result["stats"] = tp.communication_stats()
    result["data_stats"] = tp.communication_stats(axis="data")
    # Predictions read the whole batch: worker 0's, broadcast.
    result.update(_differences(reference, tp, x, x))
    result["predict_stats"] = tp.communication_stats("predict")
    result["evaluate_diff"] = abs(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0)
        - tp.evaluate(x, y, batch_size=BATCH, verbose=0)
    )
    result.update(
        _checkpoint_round_trip(tp, out_path, f"checkpoint{zero_stage}")
    )
    return result


def tensor_parallel(out_path):
    """The MLP split over the workers, then Llama's sequence shards."""
    task = strategy.cluster_resolver.task_id
    x, y = models.data_for("mlp", batch=20)
    reference = _trained_reference(x, y)
    tp = keras_tp.TensorParallelKeras(models.mlp())
    # Worker 1 reads other data on purpose: every rank must still train on
    # worker 0's batches, as the reference does.
    own_x, own_y = models.data_for("mlp", batch=20, seed=1 + task)
    _compile(tp)
    tp.fit(own_x, own_y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    result = {
        **_checkpoint_round_trip(tp, out_path),
        "task": task,
        "world_size": tp.get_parallelism_info()["world_size"],
        **_differences(reference, tp, x, own_x),
        "parameter_bytes_per_device": tp.parameter_bytes_per_device(),
    }
    result["one_speaker"] = speaker_cases.one_speaker(
        os.path.dirname(out_path), task
    )
    # Llama's LM with sequence parallelism, its shards across the workers,
    # and its loss computed from the vocabulary's split logits.
    result["sequence"] = zoo_cases.sequence_parallel_results("llama", 2)
    return result


if __name__ == "__main__":
    out, stages = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    results = {
        "tensor_parallel": tensor_parallel(out),
        "data_parallel": data_parallel(out, stages),
    }
    with open(out, "w") as f:
        json.dump(results, f)
