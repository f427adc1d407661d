"""`TensorParallelKeras(pipeline_parallel=2)` on torch: 2 ranks, 1 stage each.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_pipeline.py`.
Each rank wraps the test MLP (and GPT2's backbone) with
`pipeline_parallel=2` and trains it with Keras' `fit()` through torch's
own GPipe and 1F1B schedules (`torch.distributed.pipelining`), with
Adam, next to the same model trained on one device. Then 4 ranks train
the MLP as 2 replicas of the 2-stage pipeline (`data_parallel=2`).
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from keras_tp.pipeline.stages import split_stages  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import BATCH  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402
from tests.torch_scripts import pipeline_checks  # noqa: E402

STAGES = pipeline_checks.STAGES
REPLICAS = pipeline_checks.REPLICAS


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
        assert result["peak"] == expected


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


def test_refuses_what_it_cannot_run(runs):
    for messages in runs["refusals"]:
        assert (
            "pipeline_parallel=3 x data_parallel=1 needs 3 rank(s) but this "
            "process group has 2" in messages["ranks"]
        )
        # The refusal every backend shares.
        assert "jit_compile=False" in messages["jit_compile"]


@pytest.fixture(scope="module")
def replicas():
    """Every rank's results of `pipeline_checks.replicated_run`: rank
    `r` runs stage `r % 2` of replica `r // 2`."""
    return launch(
        pipeline_checks.replicated_run,
        world_size=STAGES * REPLICAS,
        timeout=300,
    )


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


def test_replicas_refuse_what_they_cannot_run(replicas):
    for result in replicas:
        assert "zero_stage=0" in result["zero_refused"]
        assert "data_parallel=2" in result["odd_batch_refused"]
