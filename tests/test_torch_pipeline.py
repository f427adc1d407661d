"""Pipeline stages on torch (`keras_tp.runtime.torch.pipeline`), 2 ranks.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_pipeline.py`.
Each rank runs one stage of the test MLP through torch's own GPipe and
1F1B schedules (`torch.distributed.pipelining`), with Adam, next to the
same model trained on one device.
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
from tests.pipeline_cases import MICROBATCHES  # noqa: E402
from tests.pipeline_cases import STEPS  # noqa: E402
from tests.torch_scripts import pipeline_checks  # noqa: E402

STAGES = 2


@pytest.fixture(scope="module")
def runs():
    """Each rank checked its weights against one device (within 1e-5)."""
    return launch(pipeline_checks.all_runs, world_size=STAGES, timeout=300)


@pytest.fixture(params=["gpipe", "1f1b"])
def ranks(request, runs):
    return request.param, runs[request.param]


def test_logs_the_one_device_loss(ranks):
    _, (_, last) = ranks
    assert len(last["losses"]) == STEPS
    # Keras logs the mean of the steps' losses.
    assert sum(last["losses"]) / STEPS == pytest.approx(
        last["logged"], rel=1e-5
    )


def test_each_rank_trains_only_its_stage(ranks):
    _, results = ranks
    layers = {layer.name: layer for layer in models.mlp().layers}

    def nbytes(*names):
        return sum(
            w.nbytes for name in names for w in layers[name].get_weights()
        )

    assert [r["parameter_bytes"] for r in results] == [
        nbytes("up"),
        nbytes("down", "head"),
    ]


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


def test_schedules_order_the_micro_batches(ranks):
    schedule, results = ranks
    for stage, result in enumerate(results):
        kinds = [kind for kind, *_ in result["timelines"][-1]]
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


def test_a_keras_hub_backbone_carries_its_padding_mask(runs):
    """Each rank checked its weights; the mask went forward only."""
    split = split_stages(models.gpt2_backbone(length=pipeline_cases.LENGTH), 2)
    first, last = runs["backbone"]
    pipeline_cases.check_backbone_traffic(
        {
            "forward_bytes": first["sent"]["send"]["forward_bytes"],
            "backward_bytes": last["sent"]["send"]["backward_bytes"],
        },
        split,
    )
