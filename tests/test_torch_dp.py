"""DDP and ZeRO-1/2/3 on the PyTorch backend: 2 and 4 processes over gloo.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_dp.py`.
Two launches (2 and 4 ranks) train every configuration; each rank's runs
are checked against the same model trained on one device with the whole
global batch. Memory is read from each rank's tensors, collectives from
its records.
"""

import math

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import hierarchy_cases  # noqa: E402
from tests import models  # noqa: E402
from tests.dp_cases import STEPS  # noqa: E402
from tests.dp_cases import accumulation_steps  # noqa: E402
from tests.dp_cases import check_accumulation_buffers  # noqa: E402
from tests.dp_cases import check_any_sample_count  # noqa: E402
from tests.dp_cases import check_global_batch_losses  # noqa: E402
from tests.dp_cases import check_link_probe  # noqa: E402
from tests.dp_cases import check_local_sgd_runs  # noqa: E402
from tests.dp_cases import check_loss_scale_overflow  # noqa: E402
from tests.dp_cases import check_zero_memory  # noqa: E402
from tests.dp_cases import kept_bytes  # noqa: E402
from tests.models import max_diff  # noqa: E402
from tests.torch_scripts import dp_checks  # noqa: E402

LAUNCH_TIMEOUT = 500
STAGES = [0, 1, 2, 3]
BUCKET_MB = 0.002

TWO_RANKS = (
    [("mlp", 2, 2, stage, "sgd", {}) for stage in STAGES]
    + [("mlp", 2, 2, stage, "adam", {}) for stage in STAGES]
    + [
        ("transformer_lm", 2, 2, 2, "adamw", {}),
        ("mlp", 2, 2, 0, "sgd", {"gradient_accumulation_steps": 2}),
        ("mlp", 2, 2, 2, "sgd", {"gradient_accumulation_steps": 2}),
        ("mlp", 2, 2, 0, "adam", {"bucket_cap_mb": BUCKET_MB}),
        ("mlp", 2, 2, 1, "adam", {"bucket_cap_mb": "auto"}),
        # Tensor parallelism alone: norms over each variable's shards.
        ("mlp", 2, 1, 0, "adamw", {}),
        ("mlp", 2, 1, 0, "clipped", {}),
        ("mlp", 2, 2, 1, "averaged_accumulating", {}),
        ("mlp", 2, 2, 1, "options", {}),
    ]
)
FOUR_RANKS = (
    [("mlp", 4, 4, stage, "adam", {}) for stage in STAGES]
    + [("mlp", 4, 2, stage, "adam", {}) for stage in STAGES]
    + [
        ("mlp", 4, 4, 1, "sgd", {}),
        ("transformer_lm", 4, 2, 3, "adamw", {}),
    ]
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("saved") / "zero3.keras")
    ranks = launch(
        dp_checks.api_checks,
        world_size=2,
        args=(TWO_RANKS, path),
        timeout=LAUNCH_TIMEOUT,
    )
    return path, ranks


@pytest.fixture(scope="module")
def four_ranks():
    return launch(
        dp_checks.cases,
        world_size=4,
        args=(FOUR_RANKS,),
        timeout=LAUNCH_TIMEOUT,
    )


def all_runs(two_ranks, four_ranks):
    """Every rank's run of every configuration."""
    _, ranks = two_ranks
    per_rank = [rank["cases"] for rank in ranks] + four_ranks
    return [run for runs in per_rank for run in runs]


def test_every_configuration_ran_on_every_rank(two_ranks, four_ranks):
    _, ranks = two_ranks
    assert [len(rank["cases"]) for rank in ranks] == [len(TWO_RANKS)] * 2
    assert [len(runs) for runs in four_ranks] == [len(FOUR_RANKS)] * 4


def test_matches_one_device(two_ranks, four_ranks):
    for run in all_runs(two_ranks, four_ranks):
        name, _, _, _, kind, options = run["case"]
        tolerance = 1e-4 if kind == "adamw" else 1e-5
        assert run["weights"] <= tolerance, run["case"]
        steps = accumulation_steps(kind, options)
        assert run["iterations"] == STEPS // steps, run["case"]
        if "gradient_accumulation_steps" not in options:
            # The logged loss is the global batch's, not this rank's.
            np.testing.assert_allclose(
                run["losses"], run["reference_losses"], rtol=1e-5
            )
        assert run["consistency"]["consistent"], run


def _pure_data_parallel_adam(two_ranks, four_ranks):
    return [
        run
        for run in all_runs(two_ranks, four_ranks)
        if run["case"][4] == "adam"
        and run["case"][1] == run["case"][2]
        and not run["case"][5]
    ]


def test_memory_follows_zero_formulas(two_ranks, four_ranks):
    runs = _pure_data_parallel_adam(two_ranks, four_ranks)
    assert len(runs) == 2 * 4 + 4 * 4
    for run in runs:
        _, _, data_parallel, zero_stage, _, _ = run["case"]
        measured = [
            run[key]
            for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
        ]
        check_zero_memory(measured, run["psi"], data_parallel, zero_stage)


def test_only_accumulation_keeps_gradients(two_ranks, four_ranks):
    """No gradient byte is kept between steps with one micro-batch per
    update; with two, a whole gradient (DDP, ZeRO-1) or a partition."""
    for run in all_runs(two_ranks, four_ranks):
        _, _, data_parallel, zero_stage, kind, options = run["case"]
        steps = accumulation_steps(kind, options)
        _, expected, _ = kept_bytes(
            run["psi"], data_parallel, zero_stage, steps
        )
        assert run["gradient_bytes"] == expected, run["case"]
    _, ranks = two_ranks
    for rank in ranks:
        check_accumulation_buffers(rank["accumulation_buffers"], 2)


def test_communication_is_the_zero_minimum(two_ranks, four_ranks):
    for run in _pure_data_parallel_adam(two_ranks, four_ranks):
        stage = run["case"][3]
        psi = run["psi"]
        stats = run["data_stats"]
        # One all-reduce of the metrics' state per step, forward.
        assert stats["all_reduce"]["forward_calls"] == 1
        synced = {k: v["optimizer_bytes"] for k, v in stats.items()}
        if stage == 0:
            assert synced == {"all_reduce": psi}
            assert stats["all_reduce"]["optimizer_calls"] == 1
        elif stage in (1, 2):
            assert synced["reduce_scatter"] == psi
            assert synced["all_gather"] == psi
        else:
            # Gathered forward, gathered again for the backward pass (only
            # what it reads: kernels, not biases, not the first layer's),
            # the gradient reduce-scattered: at most 3 x psi.
            assert stats["all_gather"]["forward_bytes"] == psi
            assert (
                stats["all_gather"]["backward_bytes"]
                == run["backward_kernel_bytes"]
            )
            assert stats["reduce_scatter"]["backward_bytes"] == psi
            assert synced == {k: 0 for k in synced}


def test_ddp_buckets_are_cut_by_bucket_cap(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        (run,) = [
            r
            for r in rank["cases"]
            if r["case"][5].get("bucket_cap_mb") == BUCKET_MB
        ]
        calls = math.ceil(run["psi"] / (BUCKET_MB * 2**20))
        assert calls > 1
        stats = run["data_stats"]["all_reduce"]
        assert stats["optimizer_calls"] == calls == run["buckets"]
        assert stats["optimizer_bytes"] == run["psi"]


def test_ddp_sends_buckets_during_the_backward_pass(two_ranks):
    """DDP's pieces start as their gradients are made (the runs match one
    device and count the ZeRO minimum, as the tests above check)."""
    _, ranks = two_ranks
    for rank in ranks:
        for run in rank["cases"]:
            name, _, data_parallel, stage, _, options = run["case"]
            overlaps = (
                stage == 0
                and data_parallel > 1
                and "gradient_accumulation_steps" not in options
            )
            assert run["overlap"] == overlaps, run["case"]
            if not overlaps:
                assert run["timeline"] == [], run["case"]
                continue
            (bucket,) = run["timeline"]
            assert 0 < bucket["first_ready"] <= bucket["ready"], bucket
            assert bucket["ready"] <= bucket["finished"], bucket
            if options.get("bucket_cap_mb") == BUCKET_MB:
                # Several pieces: the first left before the last was made.
                assert bucket["first_ready"] < bucket["ready"], bucket


def test_auto_bucket_size_is_the_same_on_every_rank(two_ranks):
    _, ranks = two_ranks
    chosen = set()
    for rank in ranks:
        (run,) = [
            run
            for run in rank["cases"]
            if run["case"][-1].get("bucket_cap_mb") == "auto"
        ]
        check_link_probe(run["sharding_info"])
        chosen.add(run["bucket_cap_mb"])
    # Every rank fitted the slowest rank's times.
    assert len(chosen) == 1


def test_zero3_save_loads_in_plain_keras(two_ranks):
    path, ranks = two_ranks
    # The partitions were gathered for the file and are partitions again.
    full = [list(v.shape) for v in models.mlp().trainable_variables]
    for rank in ranks:
        assert all(
            math.prod(local) * 2 == math.prod(shape)
            for local, shape in zip(rank["shapes_after_save"], full)
        )
    # In this process: plain Keras, no process group, no keras_tp.
    loaded = keras.saving.load_model(path)
    weights = [np.array(w) for w in ranks[0]["weights"]]
    assert max_diff(loaded.get_weights(), weights) == 0.0


def test_evaluate_and_predict_are_global(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        tp_logs, reference_logs = rank["evaluate"]
        np.testing.assert_allclose(tp_logs, reference_logs, rtol=1e-5)
        assert rank["predict"] <= 1e-5
        check_any_sample_count(rank["any_sample_count"])


def test_errors(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        assert "cannot be split evenly" in rank["batch_error"]
        assert "zero_stage=2" in rank["stage_error"]
        # Each rank updates its ZeRO partition, or its shards: LAMB's
        # norms would be theirs.
        partitions, shards = rank["lamb_errors"]
        assert "(Lamb) updates an entry" in partitions
        assert "(zero_stage=1 partitions)" in partitions
        assert "(tensor_parallel=2 shards)" in shards
        # MaxNorm over the axis a Row split cuts; NonNeg holds per entry.
        assert "'down/kernel' has a constraint" in rank["constraint_error"]
        assert rank["constrained"] <= 1e-5


def test_consistency_check_finds_a_drifted_replica(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        drift = rank["drift"]
        assert not drift["consistent"]
        assert drift["max_difference"] == pytest.approx(0.5)
        assert drift["variables"]["head/kernel"] == pytest.approx(0.5)
        assert drift["variables"]["up/kernel"] == 0.0


def test_local_sgd_matches_replicas_trained_apart(two_ranks):
    """Each rank steps alone and synchronises every `local_sgd_steps`;
    only those steps send."""
    _, ranks = two_ranks
    for rank in ranks:
        check_local_sgd_runs(rank["local_sgd"])


def test_batchnorm_normalises_by_the_global_batch(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        difference, consistency = rank["batchnorm"]
        assert difference <= 1e-6
        assert consistency["consistent"], consistency


def test_losses_whose_rows_mean_differs_are_the_global_batchs(two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        check_global_batch_losses(rank["global_losses"])


def test_hierarchical_reduction_on_two_nodes():
    """4 ranks launched as 2 nodes of 2 (as torchrun numbers them): each
    rank matches one device and sends half its gradient bytes across
    nodes, the rest within its node."""
    results = launch(
        hierarchy_cases.runs,
        world_size=4,
        nproc_per_node=2,
        timeout=LAUNCH_TIMEOUT,
    )
    hierarchy_cases.check_runs(results)


def _one_speaker_on_this_rank(directory):
    import os

    import torch.distributed as dist

    from tests import speaker_cases

    # Before the model is wrapped, the process group is not joined yet.
    result = speaker_cases.one_speaker(
        directory, int(os.environ["RANK"]), world_size=2, data_parallel=2
    )
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return results


def test_the_first_rank_speaks_for_the_job(tmp_path):
    # Rank 1 builds other weights than rank 0; both train from rank 0's,
    # and only rank 0 prints progress and writes the CSV log.
    from tests import speaker_cases

    ranks = launch(
        _one_speaker_on_this_rank,
        world_size=2,
        args=(str(tmp_path),),
        timeout=LAUNCH_TIMEOUT,
    )
    speaker_cases.check_one_speaker(ranks)


def test_a_loss_scale_overflow_on_one_row_skips_the_step_everywhere(
    two_ranks,
):
    _, ranks = two_ranks
    for rank in ranks:
        check_loss_scale_overflow(rank["loss_scale"])
