"""One process of the JAX multi-host tests (tests/test_jax.py).

Two processes with two virtual CPU devices each, over `jax.distributed`
(gloo). They run TP=4: train the demo LM next to the same model on one
local device, gather the weights, save on process 0 and record the
largest differences; then `tests/hierarchy_cases.py` on a data axis of 4
over the 2 hosts, and `tests/speaker_cases.py`. Each process writes the
results as JSON:

    python tests/jax_scripts/multihost.py PORT PROCESS_ID OUT_DIR
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_tp.demo.models import counting_sequences  # noqa: E402
from keras_tp.demo.models import transformer_lm  # noqa: E402


def main():
    x, y = counting_sequences(64)
    reference = transformer_lm()
    tp = keras_tp.TensorParallelKeras(transformer_lm(), world_size=4)
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    weights = tp.get_weights()
    predicted = [
        m.predict(x[:16], batch_size=8, verbose=0) for m in (reference, tp)
    ]
    path = os.path.join(out_dir, "multihost.keras")
    tp.save(path)
    result = {
        "devices": tp.get_parallelism_info()["devices"],
        "weights": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(weights, reference.get_weights())
        ),
        "predicted": float(np.max(np.abs(predicted[0] - predicted[1]))),
    }
    if jax.process_index() == 0:
        loaded = keras.saving.load_model(path)
        result["saved"] = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(loaded.get_weights(), weights)
        )
    return result


def hierarchical():
    from tests import hierarchy_cases

    return hierarchy_cases.runs()


if __name__ == "__main__":
    # One start of jax.distributed runs both: starting it is the slow part.
    from tests import share_cases
    from tests import speaker_cases

    results = {
        "tensor_parallel": main(),
        "hierarchical": hierarchical(),
        # predict() gathers the data rows' outputs, which span both hosts.
        "one_speaker": speaker_cases.one_speaker(
            out_dir, process_id, world_size=4, data_parallel=2
        ),
        "shares": share_cases.shares(process_id, world_size=4, data_parallel=2),
    }
    with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
        json.dump(results, f)
