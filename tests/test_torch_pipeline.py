"""`TensorParallelKeras(pipeline_parallel=2)` on torch: 2 ranks, 1 stage each.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_pipeline.py`.
Each rank wraps the test MLP (and GPT2's backbone) with
`pipeline_parallel=2` and trains it with Keras' `fit()` through
keras_tp's GPipe and 1F1B schedules, each rank running its stage's
actions, with Adam, next to the same model trained on one device. Then
4 ranks train the MLP as 2 replicas of the 2-stage pipeline
(`data_parallel=2`, with DDP and with ZeRO-1), and GPT2's backbone as 2
stages split over 2 tensor-parallel ranks each (`world_size=4`).
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from keras_tp.pipeline.cutting import split_stages  # noqa: E402
from tests import checkpoint_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import BATCH  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402
from tests.pipeline_cases import OWN_STATES  # noqa: E402
from tests.torch_scripts import pipeline_checks  # noqa: E402

STAGES = pipeline_checks.STAGES
REPLICAS = pipeline_checks.REPLICAS
TENSOR_PARALLEL = pipeline_checks.TENSOR_PARALLEL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every rank's results of `pipeline_checks.all_runs`."""
    return launch(
        pipeline_checks.all_runs,
        world_size=STAGES,
        args=(str(tmp_path_factory.mktemp("pipeline")),),
        timeout=300,
    )


@pytest.fixture(params=["gpipe", "1f1b"])
def ranks(request, runs):
    return request.param, runs[request.param]


@pytest.fixture
def reference(runs):
    """The one-device model's logged loss and evaluation."""
    return runs["reference"]


def test_trains_like_one_device(ranks, reference):
    _, results = ranks
    for result in results:
        assert result["weights_error"] < 1e-5
        # Keras logs the mean of the steps' losses; every rank logs the
        # last rank's.
        assert result["logged"] == pytest.approx(reference["logged"], rel=1e-5)
    assert results[0]["logged"] == results[1]["logged"]


def test_evaluates_predicts_and_calls_like_one_device(ranks, reference):
    _, results = ranks
    for result in results:
        for name in ("evaluated_before", "evaluated"):
            assert result[name] == pytest.approx(reference[name], rel=1e-5)
        assert result["predict_error"] < 1e-5
        # A direct call `tp(x)` runs the stages on their ranks too.
        assert result["call_error"] < 1e-5


def test_saves_the_unsplit_model(runs):
    """Rank 0 wrote the file from both stages; every rank read it."""
    for result in runs["gpipe"]:
        assert result["saved_error"] < 1e-5


def test_each_rank_holds_only_its_stage(ranks):
    _, results = ranks
    for result in results:
        assert result["held"] == result["stage"]
    assert [r["stage"] for r in results] == [
        ["up/bias", "up/kernel"],
        ["down/bias", "down/kernel", "head/bias", "head/kernel"],
    ]
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    assert [r["parameter_bytes"] for r in results] == [
        {f"cpu:{rank}": size} for rank, size in enumerate(stage_bytes)
    ]
    for rank, (result, size) in enumerate(zip(results, stage_bytes)):
        # Adam's two slots of this stage's variables, its step count and
        # learning rate: no slot of the other stage.
        optimizer_bytes = result["optimizer_bytes"][f"cpu:{rank}"]
        assert 2 * size < optimizer_bytes <= 2 * size + 16


def test_sends_the_boundary_activations_and_their_gradients(ranks):
    _, (first, last) = ranks
    assert first["sent"]["send"]["backward_calls"] == 0
    assert last["sent"]["send"]["forward_calls"] == 0
    pipeline_cases.check_mlp_traffic(
        {
            "forward_bytes": first["sent"]["send"]["forward_bytes"],
            "backward_bytes": last["sent"]["send"]["backward_bytes"],
            "calls": first["sent"]["send"]["calls"]
            + last["sent"]["send"]["calls"],
        }
    )
    # The logs' metric state, from the last rank, in one broadcast.
    for result in (first, last):
        assert result["sent"]["broadcast"]["calls"] == 1


def test_schedules_order_the_micro_batches(ranks):
    schedule, results = ranks
    for stage, result in enumerate(results):
        kinds = result["kinds"]
        assert (
            sorted(kinds)
            == ["backward"] * MICROBATCHES + ["forward"] * MICROBATCHES
        )
        in_flight = peak = 0
        for kind in kinds:
            in_flight += 1 if kind == "forward" else -1
            peak = max(peak, in_flight)
        # GPipe keeps every micro-batch's activations; 1F1B at most as
        # many as the stages from this one to the last.
        expected = MICROBATCHES if schedule == "gpipe" else STAGES - stage
        assert peak == expected, (stage, kinds)
        assert result["peak"][stage] == expected


def test_the_timeline_is_every_stage_s_measured_passes(ranks):
    """`pipeline_timeline()` gathers each stage's timed passes on every
    rank: the same timeline, in which stage 1's first forward starts
    after stage 0's ends and each stage idles part of the step."""
    _, results = ranks
    timeline = results[0]["timeline"]
    for result in results:
        assert result["timeline"] == timeline
        assert result["bubble"] == results[0]["bubble"]
    for stage, spans in enumerate(timeline):
        assert [kind for kind, _, _ in spans] == results[stage]["kinds"]
        ends = [end for _, _, end in spans]
        starts = [start for _, start, _ in spans]
        assert all(start < end for start, end in zip(starts, ends))
        # One pass at a time on each stage.
        assert all(end <= start for end, start in zip(ends, starts[1:]))
    first_forward_end = timeline[0][0][2]
    assert timeline[1][0][1] >= first_forward_end
    for bubble in results[0]["bubble"]:
        assert 0 < bubble < 1


def test_a_keras_hub_backbone_carries_its_padding_mask(runs):
    """GPT2's backbone trains like one device; the mask went forward
    only."""
    first, last = runs["backbone"]
    for result in (first, last):
        assert result["weights_error"] < 1e-5
    assert first["logged"] == last["logged"]
    split = split_stages(models.gpt2_backbone(length=pipeline_cases.LENGTH), 2)
    pipeline_cases.check_backbone_traffic(
        {
            "forward_bytes": first["sent"]["send"]["forward_bytes"],
            "backward_bytes": last["sent"]["send"]["backward_bytes"],
        },
        split,
    )


def test_a_causal_lm_shares_its_tied_embedding_between_stages(runs):
    """Both stages hold GPT2's token embedding, which the last one uses
    for the logits; each step one all-reduce over the two sums their
    gradients of it (Megatron-LM's embedding group), counted on "pipe"
    as the optimizer's. Each rank checked its weights against one
    device's."""
    results = runs["causal_lm"]
    shared = results[0]["shared_bytes"]
    for result in results:
        reduced = result["pipe"]["all_reduce"]
        assert reduced["optimizer_calls"] == 1
        assert reduced["optimizer_bytes"] == reduced["bytes"] == shared
    # The ranks hold the model once, and the embedding twice.
    held = sum(result["parameter_bytes"] for result in results)
    assert held == results[0]["total_bytes"] + shared


def test_global_clipnorm_spans_every_stage(runs, replicas, tensor_parallel):
    # The norm of every stage's gradients, over one all-reduce of all the
    # ranks; a later stage's copy of the tied embedding counts for
    # nothing (counted twice, the losses drift 5e-3 from one device's).
    # `causal_lm_pipeline` checked GPT2's losses and weights.
    assert runs["causal_lm_clipped"] == [True, True]
    for result in (*replicas, *tensor_parallel):
        assert result["global_clipnorm_error"] < 1e-6


def test_a_keras_mask_crosses_the_cut_to_the_loss(runs):
    # `pipeline_cases.check_masked_predictions` asserted the loss and the
    # weights on every rank; the last stage, which computes the loss,
    # weighs each micro-batch's masked mean by its share of unmasked
    # entries, and so does evaluate().
    assert runs["masked"] == [True, True]


def test_losses_the_layers_add_enter_the_loss_and_gradients(runs):
    # `pipeline_cases.check_added_losses` asserted evaluate(), the losses
    # and the weights on every rank: each stage's layers' losses join its
    # backward pass, and their shares are summed over `pipe` for the loss.
    assert runs["added"] == [True, True]


def test_optimizer_averages_and_accumulation_equal_one_devices(runs):
    # Each stage's optimizer averages its own weights (use_ema), which
    # fit() writes into them at its end, and accumulates their gradients
    # (gradient_accumulation_steps).
    for result in runs["optimizer_state"]:
        assert result == dict.fromkeys(
            ["averaged", "accumulated", "loss_scaled", *OWN_STATES],
            pytest.approx(0, abs=1e-6),
        )


def test_refuses_what_it_cannot_run(runs):
    for messages in runs["refusals"]:
        assert (
            "TensorParallelKeras(world_size=3) runs 3 ranks "
            "(pipeline_parallel=3 x data_parallel=1" in messages["ranks"]
        )
        assert "this process group has 2 rank(s)" in messages["ranks"]
        # The refusal every backend shares.
        assert "jit_compile=False" in messages["jit_compile"]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Every rank's results of `pipeline_checks.four_rank_runs`."""
    return launch(
        pipeline_checks.four_rank_runs,
        world_size=4,
        args=(str(tmp_path_factory.mktemp("pipeline_4")),),
        timeout=300,
    )


@pytest.fixture
def replicas(four_ranks):
    """Every rank's results of `pipeline_checks.replicated_run`: rank
    `r` runs stage `r % 2` of replica `r // 2`."""
    return four_ranks["replicas"]


def test_replicas_train_evaluate_and_predict_like_one_device(replicas):
    # Each rank asserted its unsplit weights equal one device's.
    for result in replicas:
        assert result["logged"] == replicas[0]["logged"]
        assert result["logged"] == pytest.approx(
            result["reference_logged"], rel=1e-5
        )
        assert result["evaluated"] == pytest.approx(
            result["reference_evaluated"], rel=1e-5
        )
        assert result["predict_error"] < 1e-5


def test_replicas_weigh_masked_means_by_their_unmasked_entries(four_ranks):
    # `pipeline_cases.check_masked_predictions` asserted the loss and the
    # weights on every rank: the replicas' last stages sum their
    # micro-batches' shares of unmasked entries over `data`.
    assert four_ranks["replicas_masked"] == [True] * 4


def test_replicas_add_their_stages_added_losses(four_ranks):
    assert four_ranks["replicas_added"] == [True] * 4


def test_replicas_average_and_accumulate_like_one_device(four_ranks):
    # The stage's CoordinatedOptimizer accumulates, and synchronises at
    # the accumulation boundaries only.
    for result in four_ranks["replicas_optimizer_state"]:
        expected = ["averaged", "accumulated", "loss_scaled", *OWN_STATES]
        expected.remove("adafactor")
        assert result == dict.fromkeys(expected, pytest.approx(0, abs=1e-6))


def test_a_loss_scale_overflow_skips_the_step_on_every_stage(four_ranks):
    # mixed_float16: the first batch overflows on the last replica's last
    # micro-batch only; every stage of every replica skips it, as one
    # device does, and halves its scale. The clip takes the norm of the
    # unscaled gradients.
    for result in four_ranks["replicas_loss_scale"]:
        pipeline_cases.check_loss_scale_overflow(result)


def test_replicas_average_their_stage_gradients(replicas):
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    for rank, result in enumerate(replicas):
        reduced = result["data"]["all_reduce"]
        # One all-reduce of the rank's own stage's gradients per step.
        assert reduced["optimizer_calls"] == 1
        assert reduced["optimizer_bytes"] == stage_bytes[rank % STAGES]
        # The last stages also sum their metrics' updates (the loss
        # tracker's total and count); the first stages have none.
        last = rank % STAGES == STAGES - 1
        assert reduced["forward_calls"] == (1 if last else 0)
        assert reduced["forward_bytes"] == (2 * 4 if last else 0)
        # A prediction gathers the replicas' outputs.
        gathered = result["predict_gathered"]["all_gather"]
        assert gathered["calls"] == 1
        assert gathered["bytes"] == BATCH * 8 * 4


def test_replicas_send_their_half_of_the_batch(replicas):
    half = BATCH // REPLICAS
    for rank, result in enumerate(replicas):
        sent = result["pipe"]["send"]
        if rank % STAGES == 0:
            assert sent["forward_bytes"] == sent["bytes"] == half * 32 * 4
        else:
            assert sent["backward_bytes"] == sent["bytes"] == half * 32 * 4
        assert sent["calls"] == pipeline_checks.REPLICA_MICROBATCHES


@pytest.fixture
def zero_replicas(four_ranks):
    """`replicas` with `zero_stage=1`."""
    return four_ranks["replicas_zero"]


def test_zero_replicas_train_evaluate_and_predict_like_one_device(
    zero_replicas,
):
    # Each rank asserted its unsplit weights equal one device's.
    for result in zero_replicas:
        assert result["logged"] == pytest.approx(
            result["reference_logged"], rel=1e-5
        )
        assert result["evaluated"] == pytest.approx(
            result["reference_evaluated"], rel=1e-5
        )
        assert result["predict_error"] < 1e-5
        assert result["train_on_batch_error"] < 1e-5


def test_zero_replicas_partition_their_stage_optimizer_state(
    replicas, zero_replicas
):
    """ZeRO-1 over the replicas: one reduce-scatter of the stage's
    gradients and one all-gather of its updated weights per step, in
    place of DDP's all-reduce, and half of Adam's slots on each rank."""
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    for rank, (ddp, zero) in enumerate(zip(replicas, zero_replicas)):
        size = stage_bytes[rank % STAGES]
        (parameters,) = zero["parameter_bytes"].values()
        assert parameters == size
        combined = zero["data"]
        assert "all_reduce" not in combined or (
            combined["all_reduce"]["optimizer_calls"] == 0
        )
        for kind in ("reduce_scatter", "all_gather"):
            assert combined[kind]["optimizer_calls"] == 1
            assert combined[kind]["optimizer_bytes"] == size
        # Adam's two slots, halved; the same scalars (step count, learning
        # rate) on both sides.
        (ddp_bytes,) = ddp["optimizer_bytes"].values()
        (zero_bytes,) = zero["optimizer_bytes"].values()
        assert ddp_bytes - zero_bytes == size


def test_replicas_refuse_what_they_cannot_run(replicas):
    for result in replicas:
        assert "zero_stage=1" in result["zero_refused"]
        assert "data_parallel=2" in result["odd_batch_refused"]


@pytest.fixture
def tensor_parallel(four_ranks):
    """Every rank's results of `pipeline_checks.tensor_parallel_run`: rank
    `r` runs tensor-parallel shard `r % 2` of stage `r // 2`."""
    return four_ranks["tensor_parallel"]


def test_tensor_parallel_stages_train_like_one_device(tensor_parallel):
    # Each rank asserted its unsplit weights equal one device's.
    for result in tensor_parallel:
        assert result["weights_error"] < 1e-5
        assert result["logged"] == tensor_parallel[0]["logged"]
        assert result["evaluated"] == pytest.approx(
            result["reference_evaluated"], rel=1e-5
        )
        assert result["predict_error"] < 1e-5
        assert result["call_error"] < 1e-5
        # Rank 0 wrote the file from every rank's shards.
        assert result["saved_error"] < 1e-5
        assert result["set_error"] == 0.0
        # Each variable clipped by its norm over the stage's shards.
        assert result["clipnorm_error"] < 1e-6


def test_each_rank_holds_its_shard_of_its_stage(tensor_parallel, runs):
    per_rank = []
    for rank, result in enumerate(tensor_parallel):
        assert result["held"] == result["stage"]
        (size,) = result["parameter_bytes"].values()
        assert list(result["parameter_bytes"]) == [f"cpu:{rank}"]
        per_rank.append(size)
        # Adam's two slots of this rank's shard, its step count and
        # learning rate.
        optimizer_bytes = result["optimizer_bytes"][f"cpu:{rank}"]
        assert 2 * size < optimizer_bytes <= 2 * size + 16
    first, last = per_rank[:TENSOR_PARALLEL], per_rank[TENSOR_PARALLEL:]
    assert first == [first[0]] * TENSOR_PARALLEL
    assert last == [last[0]] * TENSOR_PARALLEL
    assert first[0] != last[0]
    assert tensor_parallel[0]["stage"] != tensor_parallel[-1]["stage"]
    # A tensor-parallel rank's shards of the two stages are what that rank
    # of the model split by tensor parallelism alone holds.
    plain = [
        result["parameter_bytes"][f"cpu:{rank}"]
        for rank, result in enumerate(runs["tensor_parallel_backbone"])
    ]
    assert [a + b for a, b in zip(first, last)] == plain


def test_tensor_parallel_stages_all_reduce_as_tensor_parallelism(
    tensor_parallel, runs
):
    """Each micro-batch repeats on its stage's ranks the all-reduces that
    tensor parallelism alone issues for that stage's layers."""
    expected = runs["tensor_parallel_backbone"][0]["all_reduce"]
    for model_rank in range(TENSOR_PARALLEL):
        counted = [
            tensor_parallel[stage * TENSOR_PARALLEL + model_rank]["model"]
            for stage in range(STAGES)
        ]
        for direction in ("forward", "backward"):
            assert (
                sum(c["all_reduce"][f"{direction}_bytes"] for c in counted)
                == (expected[f"{direction}_bytes"])
            )
            assert sum(
                c["all_reduce"][f"{direction}_calls"] for c in counted
            ) == (MICROBATCHES * expected[f"{direction}_calls"])
        assert all(sorted(c) == ["all_reduce"] for c in counted)
    for result in tensor_parallel:
        assert result["data"] == {}


def test_sequence_parallel_inside_the_stages(four_ranks):
    """2 stages x 2 ranks with sequence parallelism: the same weights as
    one device; the stages' forward all-reduces become reduce-scatters
    and all-gathers, and the hidden states cross the cut as sequence
    shards, each rank sending its own half (the integer mask whole), as
    their gradients come back."""
    results = four_ranks["sequence_parallel"]
    micro = BATCH // MICROBATCHES
    hidden = micro * pipeline_cases.LENGTH * 16 * 4 // TENSOR_PARALLEL
    mask = micro * pipeline_cases.LENGTH * 4
    for rank, result in enumerate(results):
        assert result["weights_error"] < 1e-5
        model = result["model"]
        assert model["reduce_scatter"]["forward_calls"] > 0
        assert model["all_gather"]["forward_calls"] > 0
        assert model.get("all_reduce", {}).get("forward_calls", 0) == 0
        sent = result["pipe"]["send"]
        if rank < TENSOR_PARALLEL:
            assert sent["forward_bytes"] == MICROBATCHES * (hidden + mask)
        else:
            assert sent["backward_bytes"] == MICROBATCHES * hidden


def test_a_routers_added_loss_under_sequence_parallelism(four_ranks):
    """Mixtral's routers run whole on sequence shards and add their
    load-balancing loss as a `DTensor`, which each stage makes whole as
    a direct call does: the same weights as one device."""
    for difference in four_ranks["moe_sequence_parallel"]:
        assert difference < 1e-5


def test_tensor_parallel_ranks_send_their_own_copy(tensor_parallel):
    """Each rank of the first stage sends its copy of the hidden states
    and the mask to its counterpart of the second stage, which sends the
    hidden states' gradients back."""
    split = split_stages(models.gpt2_backbone(length=pipeline_cases.LENGTH), 2)
    for model_rank in range(TENSOR_PARALLEL):
        first = tensor_parallel[model_rank]["pipe"]["send"]
        last = tensor_parallel[TENSOR_PARALLEL + model_rank]["pipe"]["send"]
        assert first["backward_calls"] == last["forward_calls"] == 0
        pipeline_cases.check_backbone_traffic(
            {
                "forward_bytes": first["forward_bytes"],
                "backward_bytes": last["backward_bytes"],
            },
            split,
        )


def test_a_split_activation_crosses_the_cut_as_shards(four_ranks):
    results = four_ranks["split_cut"]
    for result in results:
        assert result["styles"]["up"] == "Column(gather_output=False)"
        assert result["styles"]["down"] == "Row(input_is_parallel=True)"
        assert result["weights_error"] < 1e-5
        assert result["logged"] == pytest.approx(
            result["reference_logged"], rel=1e-5
        )
    # Each rank sends its half of `up`'s (BATCH, 32) float32 output, and
    # receives the gradient of that half.
    shard = BATCH * 32 * 4 // TENSOR_PARALLEL
    for first in results[:TENSOR_PARALLEL]:
        assert first["sent"]["forward_bytes"] == first["sent"]["bytes"] == shard
    for last in results[TENSOR_PARALLEL:]:
        assert last["sent"]["backward_bytes"] == last["sent"]["bytes"] == shard


def test_tensor_parallel_stages_refuse_an_indivisible_world(tensor_parallel):
    for result in tensor_parallel:
        assert (
            "pipeline_parallel=3 with world_size=4 and data_parallel=1"
            in result["indivisible_refused"]
        )


def test_sharded_checkpoints_of_stages_load_at_any_layout(four_ranks):
    """Each rank writes its shard of its stage (2 stages x 2-way tensor
    parallelism); a fresh pipeline and one device load them on every
    rank (each asserts its loads), and a pipeline loads one device's
    checkpoint."""
    differences, manifest = four_ranks["checkpoint"]
    assert len(differences) == 3
    assert manifest["mesh"]["pipeline_parallel"] == STAGES
    writers = sorted(f.split("-")[-1] for f in manifest["files"])
    assert writers == [f"rank{r}.safetensors" for r in range(4)]


def test_sharded_checkpoints_of_replicated_stages_load_at_any_layout(
    four_ranks,
):
    """2 replicas x 2 stages, ZeRO-1: each rank writes its stage's
    variables (the first replica's) and its partition of their Adam
    slots, which its `CoordinatedOptimizer` holds in its stage's order
    and the checkpoint keys as one device's optimizer keys them; a fresh
    pipeline and one device load them, and the pipeline loads one
    device's checkpoint."""
    differences, manifest = four_ranks["replicas_checkpoint"]
    assert len(differences) == 3
    assert manifest["mesh"]["data_parallel"] == REPLICAS
    writers = sorted(f.split("-")[-1] for f in manifest["files"])
    assert writers == [f"rank{r}.safetensors" for r in range(4)]


def test_backup_and_restore_resumes_a_pipeline_exactly(runs):
    """A 2-stage LM with dropout, stopped and resumed from its backup,
    repeats the uninterrupted run's losses: torch's shape inference
    before the first step leaves the dropouts' streams alone."""
    checkpoint_cases.check_resumed(*runs["resumed"])


def test_the_bubble_benchmark_measures_both_schedules(capsys):
    """`benchmarks/pipeline_bubble.py` at a tiny size, so that it cannot
    rot: each schedule's row, with the activations each stage held and
    the bytes each sent (a batch of 64 x 16 floats each way)."""
    from benchmarks import pipeline_bubble

    pipeline_bubble.main(
        ["--width", "16", "--layers", "2", "--steps", "1"]
        + ["--microbatches", "2"]
    )
    rows = [
        line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("| gpipe", "| 1f1b"))
    ]
    assert [(row[0], row[4]) for row in rows] == [
        ("| gpipe", "2 / 2"),
        ("| 1f1b", "2 / 1"),
    ]
    for row in rows:
        assert row[5] == "4,096 / 4,096 |"
