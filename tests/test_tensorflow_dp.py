"""DDP and ZeRO-1/2/3 on the TensorFlow backend, with and without tensor
parallelism, over the replicas of a `tf.distribute.MirroredStrategy`.

Run in a process of its own (the backend is read when Keras is imported):

    KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow_dp.py -q

The oracle is the same model on one device trained on the whole global
batch; memory is read from each replica's component of the variables,
collectives from the step's records and from the traced step's graph.
"""

import functools
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.runtime.tensorflow import TensorFlowRuntime  # noqa: E402
from tests import hierarchy_cases  # noqa: E402
from tests import models  # noqa: E402
from tests.dp_cases import BATCH  # noqa: E402
from tests.dp_cases import STEPS  # noqa: E402
from tests.dp_cases import accumulation_buffer_bytes  # noqa: E402
from tests.dp_cases import any_sample_count  # noqa: E402
from tests.dp_cases import batchnorm_after_two_steps  # noqa: E402
from tests.dp_cases import check_accumulation_buffers  # noqa: E402
from tests.dp_cases import check_any_sample_count  # noqa: E402
from tests.dp_cases import check_data_traffic  # noqa: E402
from tests.dp_cases import check_global_batch_losses  # noqa: E402
from tests.dp_cases import check_gradient_accumulation  # noqa: E402
from tests.dp_cases import check_link_probe  # noqa: E402
from tests.dp_cases import check_local_sgd_runs  # noqa: E402
from tests.dp_cases import check_loss_scale_overflow  # noqa: E402
from tests.dp_cases import check_matches_one_device  # noqa: E402
from tests.dp_cases import check_norms_with_tensor_parallelism_alone  # noqa: E402
from tests.dp_cases import check_state_kept_beside_the_variables  # noqa: E402
from tests.dp_cases import check_zero_memory  # noqa: E402
from tests.dp_cases import communication_run  # noqa: E402
from tests.dp_cases import constrained_difference  # noqa: E402
from tests.dp_cases import constraint_refusal  # noqa: E402
from tests.dp_cases import global_batch_losses  # noqa: E402
from tests.dp_cases import lamb_refusal  # noqa: E402
from tests.dp_cases import local_sgd_runs  # noqa: E402
from tests.dp_cases import loss_scale_overflow  # noqa: E402
from tests.dp_cases import make_optimizer  # noqa: E402
from tests.dp_cases import train_pair  # noqa: E402
from tests.dp_cases import train_split  # noqa: E402
from tests.models import loss_fn  # noqa: E402
from tests.models import max_diff  # noqa: E402

# Several tests read the same run; tracing a TensorFlow step takes seconds.
train_pair = functools.lru_cache(maxsize=None)(train_pair)


def dense_reference(name, kind):
    """The one-device oracle of `train_pair`, with dense gradients.

    Keras on TensorFlow gives an embedding's gradient as `IndexedSlices`,
    one row per occurrence of a token, and Adam's second moment and the
    global norm then square each occurrence apart. A data axis sums the
    gradient over the ranks first (dense, as JAX and torch always do), so
    the oracle of an embedding model takes its gradients dense.
    """
    reference = models.BUILDERS[name]()
    optimizer = make_optimizer(kind)
    apply = optimizer.apply
    optimizer.apply = lambda grads, variables=None: apply(
        [tf.convert_to_tensor(g) for g in grads], variables
    )
    reference.compile(optimizer=optimizer, loss=loss_fn())
    x, y = models.data_for(name, batch=STEPS * BATCH)
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return reference


CASES = [
    # (world_size, data_parallel, optimizer): pure DDP on 2 and 4 replicas,
    # and 2 data x 2 model.
    (2, 2, "adam"),
    (4, 4, "adam"),
    (4, 2, "sgd"),
]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size,data_parallel,kind", CASES)
def test_matches_one_device(world_size, data_parallel, kind, zero_stage):
    reference, tp, ref_history, tp_history = train_pair(
        "mlp", world_size, data_parallel, zero_stage, kind
    )
    check_matches_one_device(reference, tp, ref_history, tp_history)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_with_one_data_rank_matches_one_device(zero_stage):
    # ZeRO over a data axis of size 1, with the model split over 2 replicas:
    # the data axis exchanges nothing, the model axis still does.
    reference, tp, _, _ = train_pair("mlp", 2, 1, zero_stage, "adam")
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5
    assert tp.communication_stats(axis="model")["all_reduce"]["calls"] > 0


@pytest.mark.parametrize(
    "world_size,data_parallel,zero_stage", [(4, 4, 1), (4, 2, 2)]
)
def test_adamw_clipnorm_schedule_match(world_size, data_parallel, zero_stage):
    reference, tp, _, _ = train_pair(
        "mlp", world_size, data_parallel, zero_stage, "adamw"
    )
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-4


def test_norms_with_tensor_parallelism_alone_match_one_device():
    check_norms_with_tensor_parallelism_alone()


def test_state_an_optimizer_keeps_beside_its_variables_matches():
    check_state_kept_beside_the_variables()
    # Each replica updates its shards: LAMB's norms would be a shard's.
    message = lamb_refusal(2, 1, 0)
    assert "(Lamb) updates an entry of a variable" in message
    assert "(tensor_parallel=2 shards)" in message
    message = constraint_refusal(2, 1)
    assert "Variable 'down/kernel' has a constraint (MaxNorm)" in message
    # Each replica constrains its shards (NonNeg: entry by entry).
    assert constrained_difference(4, 2) <= 1e-5


def test_transformer_adamw_clipnorm_schedule_match():
    # 2 data x 2 model ranks, ZeRO-3: attention and MLP regions gather
    # their partitions, the embeddings' gradients are synchronised dense.
    tp, _ = train_split("transformer_lm", 4, 2, 3, "adamw")
    reference = dense_reference("transformer_lm", "adamw")
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-4


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_gradient_accumulation_matches_larger_batch(zero_stage):
    check_gradient_accumulation(zero_stage)


def test_only_accumulation_keeps_gradients():
    # Whole buffers under DDP and ZeRO-1, partitions under ZeRO-2 and 3;
    # test_memory_follows_zero_formulas checks there are none otherwise.
    check_accumulation_buffers(accumulation_buffer_bytes(4), 4)


def test_ema_weights_are_written_at_the_end_of_fit():
    reference = models.mlp()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2, zero_stage=1
    )
    x, y = models.data_for("mlp", batch=STEPS * BATCH)
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True),
            loss=loss_fn(),
        )
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5


@pytest.mark.parametrize("data_parallel", [2, 4])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_memory_follows_zero_formulas(zero_stage, data_parallel):
    reference, tp, _, _ = train_pair(
        "mlp", data_parallel, data_parallel, zero_stage, "adam"
    )
    psi = sum(v.numpy().nbytes for v in reference.trainable_variables)
    info = tp.get_gradient_sharding_info()
    assert len(info["parameter_bytes"]) == data_parallel
    largest = [
        max(info[key].values())
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    ]
    check_zero_memory(largest, psi, data_parallel, zero_stage)


BUCKET_MB = 0.002


def _graph_collectives(tp, x, y):
    """Collective ops one replica issues in a traced training step.

    `{op type: count}` on the first replica's device, read from the graph
    of the step, so it counts what TensorFlow really runs.
    """
    step = tf.function(lambda x, y: tp.train_step((x, y)))
    graph = step.get_concrete_function(x, y).graph
    device = tp._runtime.strategy.extended.worker_devices[0]
    counts = {}
    for op in graph.get_operations():
        if op.type.startswith("Collective") and op.device == device:
            counts[op.type] = counts.get(op.type, 0) + 1
    return counts


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_communication_is_the_zero_minimum(zero_stage):
    tp, psi, x, y = communication_run(zero_stage, BUCKET_MB)
    # ZeRO-3: the tape keeps the gathered parameters for the backward pass,
    # which reduce-scatters: 2 psi.
    check_data_traffic(tp, psi, zero_stage, BUCKET_MB)
    # The loss and metrics are computed once from the rows' outputs: no
    # collective serves them.
    data = tp.communication_stats(axis="data")
    assert data.get("all_reduce", {}).get("forward_calls", 0) == 0
    # The traced step issues exactly the recorded collectives; a
    # reduce-scatter is an all-reduce on CPUs (TensorFlow implements
    # CollectiveReduceScatterV2 for NCCL only).
    graph = _graph_collectives(tp, x, y)
    stats = tp.communication_stats()
    reduces = sum(
        stats.get(kind, {}).get("calls", 0)
        for kind in ("all_reduce", "reduce_scatter")
    )
    assert graph.get("CollectiveReduceV2", 0) == reduces
    assert graph.get("CollectiveGatherV2", 0) == stats.get(
        "all_gather", {}
    ).get("calls", 0)


def test_zero3_save_loads_in_plain_keras(tmp_path):
    reference, tp, _, _ = train_pair("mlp", 4, 2, 3, "sgd")
    path = str(tmp_path / "model.keras")
    bytes_before = tp.parameter_bytes_per_device()
    tp.save(path)
    loaded = keras.saving.load_model(path)
    assert max_diff(loaded.get_weights(), tp.get_weights()) == 0.0
    # Saving leaves the parameters partitioned.
    assert tp.parameter_bytes_per_device() == bytes_before
    x, _ = models.data_for("mlp", batch=BATCH)
    assert max_diff([loaded.predict(x, verbose=0)], [tp.predict(x)]) <= 1e-5
    # A direct call runs in the replicas, where the partitions are gathered.
    assert max_diff([tp(x)], [reference(x)]) <= 1e-5


def test_set_weights_fills_every_partition():
    reference, tp, _, _ = train_pair("mlp", 4, 2, 3, "sgd")
    fresh = keras_tp.TensorParallelKeras(
        models.mlp(seed=5), world_size=4, data_parallel=2, zero_stage=3
    )
    fresh.set_weights(tp.get_weights())
    assert max_diff(fresh.get_weights(), reference.get_weights()) <= 1e-5
    fresh.compile(optimizer="sgd", loss=loss_fn())
    assert fresh.check_gradient_consistency()["consistent"]


def test_evaluate_and_predict_are_global():
    reference, tp, _, _ = train_pair("mlp", 4, 2, 2, "sgd")
    x, y = models.data_for("mlp", batch=16, seed=3)
    reference.compile(loss=loss_fn(), metrics=["accuracy"])
    ref_logs = reference.evaluate(x, y, batch_size=8, verbose=0)
    tp_logs = tp.evaluate(x, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(tp_logs, ref_logs, rtol=1e-5)
    assert max_diff([reference.predict(x, verbose=0)], [tp.predict(x)]) <= 1e-5
    # Batches that do not divide by data_parallel are padded, not refused.
    check_any_sample_count(any_sample_count(reference, tp))


def test_mesh_follows_tensorflow_rank_order():
    # TensorFlow ranks a collective group by device name, whatever order
    # the devices are given in; the mesh is laid out in that order.
    reference, expected, _, _ = train_pair("mlp", 4, 2, 2, "sgd")
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        device_ids=["cpu:3", "cpu:1", "cpu:2", "cpu:0"],
        data_parallel=2,
        zero_stage=2,
    )
    assert tp.device_mesh.devices.flatten().tolist() == [
        "cpu:0",
        "cpu:1",
        "cpu:2",
        "cpu:3",
    ]
    tp.compile(optimizer=make_optimizer("sgd"), loss=loss_fn())
    x, y = models.data_for("mlp", batch=STEPS * BATCH)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5


def test_losses_whose_rows_mean_differs_are_the_global_batchs():
    check_global_batch_losses(global_batch_losses(2, 2))


@pytest.mark.parametrize("world_size,data_parallel", [(2, 2), (4, 2)])
def test_batchnorm_normalises_by_the_global_batch(world_size, data_parallel):
    difference, consistency = batchnorm_after_two_steps(
        world_size, data_parallel, 1
    )
    assert difference <= 1e-6
    assert consistency["consistent"], consistency


def test_run_eagerly_traces_the_step():
    reference, _, _, _ = train_pair("mlp", 2, 2, 1, "adam")
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2, zero_stage=1
    )
    tp.compile(
        optimizer=make_optimizer("adam"), loss=loss_fn(), run_eagerly=True
    )
    x, y = models.data_for("mlp", batch=STEPS * BATCH)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5
    assert tp.communication_stats(axis="data")["all_gather"]["calls"] == 1


def test_batch_that_does_not_split_is_refused():
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=4, data_parallel=4
    )
    tp.compile(optimizer="sgd", loss=loss_fn())
    x, y = models.data_for("mlp", batch=6)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        tp.fit(x, y, batch_size=6, verbose=0)


def test_partitioned_variables_cannot_be_read_whole_by_mistake():
    _, tp, _, _ = train_pair("mlp", 4, 2, 3, "sgd")
    kernel = tp.get_layer("head").kernel
    with pytest.raises(ValueError):
        kernel.numpy()
    with pytest.raises(RuntimeError, match="holds ZeRO-3 partitions"):
        tp.get_layer("head")(np.zeros((2, 32), "float32"))


def test_auto_bucket_size_is_measured_on_the_data_axis():
    reference, tp, ref_history, tp_history = train_pair(
        "mlp", 4, 4, 0, "adam", bucket_cap_mb="auto"
    )
    check_matches_one_device(reference, tp, ref_history, tp_history)
    check_link_probe(tp.get_gradient_sharding_info())


def test_hierarchical_reduction_over_two_hosts(monkeypatch):
    # The 4 devices posed as 2 workers of 2 (as `_rank_hosts` reads them
    # across workers, which on CPUs run one replica each): the groups of
    # the two levels run on one host as across workers.
    monkeypatch.setattr(
        TensorFlowRuntime, "_rank_hosts", lambda self: [0, 0, 1, 1]
    )
    hierarchy_cases.check_runs(hierarchy_cases.runs())


def test_local_sgd_matches_replicas_trained_apart():
    """Each replica's components step alone and synchronise every
    `local_sgd_steps`; only those steps send."""
    check_local_sgd_runs(local_sgd_runs())


@pytest.mark.parametrize("world_size,data_parallel", [(2, 2), (4, 2), (2, 1)])
def test_a_loss_scale_overflow_on_one_row_skips_the_step_everywhere(
    world_size, data_parallel
):
    check_loss_scale_overflow(loss_scale_overflow(world_size, data_parallel))
