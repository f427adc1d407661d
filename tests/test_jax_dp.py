"""DDP and ZeRO-1/2/3 on the JAX backend, with and without tensor parallelism.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_dp.py`.
The oracle is the same model on one device trained on the whole global
batch; memory is read from the arrays, collectives from the step's records
and from its compiled HLO.
"""

import os
import re
import warnings

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_tp.parallel.entrywise import reads_across_entries  # noqa: E402
from tests import models  # noqa: E402
from tests.dp_cases import BATCH  # noqa: E402
from tests.dp_cases import accumulation_buffer_bytes  # noqa: E402
from tests.dp_cases import any_sample_count  # noqa: E402
from tests.dp_cases import batchnorm_after_two_steps  # noqa: E402
from tests.dp_cases import batchnorm_network  # noqa: E402
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
from tests.dp_cases import train_pair  # noqa: E402
from tests.models import loss_fn  # noqa: E402
from tests.models import max_diff  # noqa: E402

CASES = [
    # (world_size, data_parallel): pure DDP on 2 and 4, and 2 data x 2 model.
    (2, 2),
    (4, 4),
    (4, 2),
]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size,data_parallel", CASES)
def test_matches_one_device(world_size, data_parallel, zero_stage):
    kind = "adam" if world_size != data_parallel else "sgd"
    reference, tp, ref_history, tp_history = train_pair(
        "mlp", world_size, data_parallel, zero_stage, kind
    )
    check_matches_one_device(reference, tp, ref_history, tp_history)


def test_norms_with_tensor_parallelism_alone_match_one_device():
    # Global arrays: Keras' own norms read whole variables.
    check_norms_with_tensor_parallelism_alone()
    reference, tp, _, _ = train_pair("mlp", 2, 1, 0, "lamb")
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5


def test_state_an_optimizer_keeps_beside_its_variables_matches():
    check_state_kept_beside_the_variables()


def test_a_constraint_reading_across_a_cut_is_refused():
    # Per-rank steps (a data axis): each rank constrains its shards.
    message = constraint_refusal(4, 2)
    assert "Variable 'down/kernel' has a constraint (MaxNorm)" in message
    assert "across axis 0" in message
    assert constrained_difference(4, 2) <= 1e-5


def test_the_entrywise_probe_reads_through_wrapping_optimizers():
    scaled = keras.optimizers.LossScaleOptimizer
    assert reads_across_entries(scaled(keras.optimizers.Lamb()))
    assert not reads_across_entries(scaled(keras.optimizers.SGD()))


@pytest.mark.parametrize("data_parallel,zero_stage", [(2, 1), (1, 1)])
def test_an_optimizer_reading_across_entries_updates_no_piece(
    data_parallel, zero_stage
):
    # Per-rank steps: each rank's shards (model axis), its ZeRO partition.
    message = lamb_refusal(2 * data_parallel, data_parallel, zero_stage)
    assert "(Lamb) updates an entry of a variable" in message
    assert "tensor_parallel=2 shards" in message
    assert ("zero_stage=1 partitions" in message) == (data_parallel > 1)


@pytest.mark.parametrize(
    "world_size,data_parallel,zero_stage", [(4, 2, 2), (4, 4, 1), (4, 2, 3)]
)
def test_adamw_clipnorm_schedule_match(world_size, data_parallel, zero_stage):
    reference, tp, _, _ = train_pair(
        "transformer_lm", world_size, data_parallel, zero_stage, "adamw"
    )
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-4


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_gradient_accumulation_matches_larger_batch(zero_stage):
    check_gradient_accumulation(zero_stage)


def test_only_accumulation_keeps_gradients():
    # Whole buffers under DDP and ZeRO-1, partitions under ZeRO-2 and 3;
    # test_memory_follows_zero_formulas checks there are none otherwise.
    check_accumulation_buffers(accumulation_buffer_bytes(4), 4)


@pytest.mark.parametrize("data_parallel", [2, 4])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_memory_follows_zero_formulas(zero_stage, data_parallel):
    reference, tp, _, _ = train_pair(
        "mlp", data_parallel, data_parallel, zero_stage, "adam"
    )
    psi = sum(v.numpy().nbytes for v in reference.trainable_variables)
    info = tp.get_gradient_sharding_info()
    largest = [
        max(info[key].values())
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    ]
    check_zero_memory(largest, psi, data_parallel, zero_stage)


BUCKET_MB = 0.002


def _count_hlo(text, op):
    calls = re.findall(rf"\s{op}(?:-start)?\(([^)]*)\)", text)
    return sum(operands.count("%") for operands in calls)


def _compiled_step(tp, x, y):
    state = (
        [v.value for v in tp.trainable_variables],
        [v.value for v in tp.non_trainable_variables],
        [v.value for v in tp.optimizer.variables],
        [v.value for v in tp.metrics_variables],
    )
    return jax.jit(tp.train_step).lower(state, (x, y)).compile().as_text()


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_communication_is_the_zero_minimum(zero_stage):
    tp, psi, x, y = communication_run(zero_stage, BUCKET_MB)
    check_data_traffic(tp, psi, zero_stage, BUCKET_MB)
    # One all-reduce of the metrics' state per step, forward. ZeRO-3
    # gathers once (see the docs: XLA merges the backward re-gather with
    # the forward one).
    data = tp.communication_stats(axis="data")
    assert data["all_reduce"]["forward_calls"] == 1
    hlo = _compiled_step(tp, x, y)
    stats = tp.communication_stats()
    assert _count_hlo(hlo, "all-reduce") == stats["all_reduce"]["calls"]
    assert _count_hlo(hlo, "all-gather") == stats.get("all_gather", {}).get(
        "calls", 0
    )
    assert _count_hlo(hlo, "reduce-scatter") == stats.get(
        "reduce_scatter", {}
    ).get("calls", 0)


def test_zero3_save_loads_in_plain_keras(tmp_path):
    _, tp, _, _ = train_pair("mlp", 4, 2, 3, "adam")
    path = str(tmp_path / "model.keras")
    tp.save(path)
    loaded = keras.saving.load_model(path)
    assert max_diff(loaded.get_weights(), tp.get_weights()) == 0.0
    x, _ = models.data_for("mlp", batch=BATCH)
    assert max_diff([loaded.predict(x, verbose=0)], [tp.predict(x)]) <= 1e-5


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


def test_batch_that_does_not_split_is_refused():
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=4, data_parallel=4
    )
    tp.compile(optimizer="sgd", loss=loss_fn())
    x, y = models.data_for("mlp", batch=6)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        tp.fit(x, y, batch_size=6, verbose=0)


def test_optimizer_stage_must_match_model():
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2, zero_stage=1
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.SGD(0.1), zero_stage=2
    )
    with pytest.raises(ValueError, match="zero_stage=2"):
        tp.compile(optimizer=optimizer, loss=loss_fn())
    with pytest.raises(ValueError, match="accumulates gradients itself"):
        keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        )
    # Given to compile(), the wrapper accumulates instead, synchronising
    # at the accumulation boundaries only.
    tp.compile(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
        loss=loss_fn(),
    )
    assert tp.optimizer.accumulation_steps == 2
    assert not tp.optimizer.inner_optimizer.gradient_accumulation_steps


@pytest.mark.parametrize("world_size,data_parallel", [(2, 2), (4, 2)])
def test_batchnorm_normalises_by_the_global_batch(world_size, data_parallel):
    difference, consistency = batchnorm_after_two_steps(
        world_size, data_parallel, 1
    )
    assert difference <= 1e-6
    assert consistency["consistent"], consistency


def test_losses_whose_rows_mean_differs_are_the_global_batchs():
    check_global_batch_losses(global_batch_losses(2, 2))


class SpreadPenalty(keras.layers.Layer):
    """Adds its input's variance over the batch as a loss: a statistic of
    the batch, not a mean over samples (as a router's balancing loss)."""

    def call(self, x):
        self.add_loss(keras.ops.var(x, axis=0)[0])
        return x


def test_losses_a_layer_adds_are_named_with_a_data_axis():
    # Each data row adds its own samples' spread, and the rows' mean is
    # not the global batch's: the user is told which layer and the fix.
    x, y = models.data_for("mlp", batch=BATCH)
    inputs = keras.Input((16,))
    outputs = models.mlp()(SpreadPenalty(name="spread")(inputs))
    for data_parallel, warned in ((2, 1), (1, 0)):
        tp = keras_tp.TensorParallelKeras(
            keras.Model(inputs, outputs),
            world_size=2 * data_parallel,
            data_parallel=data_parallel,
        )
        tp.compile(optimizer="sgd", loss=loss_fn())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tp.train_on_batch(x, y)
        named = [
            w
            for w in caught
            if "Layers ['spread'] add losses in their call" in str(w.message)
            and "Train with data_parallel=1" in str(w.message)
        ]
        assert len(named) == warned, [str(w.message) for w in caught]


def test_batchnorm_statistics_stay_each_replicas_under_local_sgd():
    # Local SGD's replicas train apart, their batch statistics too: its
    # steps send no BatchNormalization all-reduce over data, where DDP's
    # send two (the mean's and the variance's sums).
    x, y = models.data_for("mlp", batch=8)
    forward = []
    for local_sgd_steps in (None, 2):
        tp = keras_tp.TensorParallelKeras(
            batchnorm_network(), world_size=2, data_parallel=2
        )
        optimizer = keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(0.1), local_sgd_steps=local_sgd_steps
        )
        tp.compile(optimizer=optimizer, loss=loss_fn())
        tp.train_on_batch(x, y)
        stats = tp.communication_stats("train", axis="data")
        forward.append(stats["all_reduce"]["forward_calls"])
    assert forward[0] - forward[1] == 2, forward


def test_hierarchical_collectives_equal_flat_ones():
    """The data axis as 2 hosts of 2 devices: hierarchical collectives
    give what flat ones give, and each level counts its calls."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec

    from keras_tp.collectives.hierarchy import HierarchicalAdapter
    from keras_tp.collectives.jax import JaxCollectiveAdapter

    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    within = JaxCollectiveAdapter(2, "data", False, [[0, 1], [2, 3]])
    across = JaxCollectiveAdapter(2, "data", False, [[0, 2], [1, 3]])
    hierarchical = HierarchicalAdapter(within, across)
    flat = JaxCollectiveAdapter(4, "data", False)

    def collectives(adapter, x, odd):
        return [
            adapter.all_reduce(x, "sum"),
            adapter.all_reduce(odd, "mean"),  # 7 values: padded to 8
            adapter.all_reduce(x, "max"),
            adapter.reduce_scatter(x, axis=1, op="sum"),
            adapter.all_gather(x, axis=0),
            adapter.broadcast(x, root=3),
            jax.numpy.reshape(adapter.rank(), (1,)),
        ]

    def body(x, odd):
        return collectives(hierarchical, x, odd) + collectives(flat, x, odd)

    spec = PartitionSpec("data")
    run = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=spec,
            check_vma=False,
        )
    )
    x = np.random.default_rng(0).normal(size=(4 * 3, 8)).astype("float32")
    odd = np.random.default_rng(1).normal(size=(4 * 7,)).astype("float32")
    with hierarchical.stats.recording("train"):
        outputs = run(x, odd)
    levels, flats = outputs[:7], outputs[7:]
    for level, plain in zip(levels, flats):
        np.testing.assert_allclose(level, plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(levels[-1], [0, 1, 2, 3])
    across_calls = hierarchical.stats.summary(axis="data/across_hosts")
    # Half of each rank's values cross hosts: x's 24 floats for the sum
    # and for the reduce-scatter, odd's 7 padded to 8 for the mean.
    assert across_calls["reduce_scatter"]["bytes"] == 4 * (24 + 8 + 24) // 2


def test_hierarchical_on_one_host_reduces_in_one_level(caplog):
    caplog.set_level("INFO", logger="keras_tp")
    reference, tp, ref_history, tp_history = train_pair(
        "mlp", 4, 4, 0, "sgd", hierarchical=True
    )
    check_matches_one_device(reference, tp, ref_history, tp_history)
    assert tp.get_gradient_sharding_info()["hosts"] == 1
    assert "sit on 1 host(s)" in caplog.text
    assert set(tp.communication_stats(axis="data")) == {"all_reduce"}


def test_auto_bucket_size_is_measured_on_the_data_axis():
    reference, tp, ref_history, tp_history = train_pair(
        "mlp", 4, 4, 1, "adam", bucket_cap_mb="auto"
    )
    check_matches_one_device(reference, tp, ref_history, tp_history)
    check_link_probe(tp.get_gradient_sharding_info())


def test_local_sgd_matches_replicas_trained_apart():
    """Replicas step alone on their blocks of each per-replica variable
    and synchronise every `local_sgd_steps`; only those steps send."""
    check_local_sgd_runs(local_sgd_runs())


@pytest.mark.parametrize("world_size,data_parallel", [(2, 2), (4, 2)])
def test_a_loss_scale_overflow_on_one_row_skips_the_step_everywhere(
    world_size, data_parallel
):
    check_loss_scale_overflow(loss_scale_overflow(world_size, data_parallel))
