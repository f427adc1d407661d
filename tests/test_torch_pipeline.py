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
from tests import models  # noqa: E402
from tests.torch_scripts import pipeline_checks  # noqa: E402
from tests.torch_scripts.pipeline_checks import BATCH  # noqa: E402
from tests.torch_scripts.pipeline_checks import MICROBATCHES  # noqa: E402
from tests.torch_scripts.pipeline_checks import STEPS  # noqa: E402

STAGES = 2


@pytest.fixture(scope="module", params=["gpipe", "1f1b"])
def ranks(request):
    results = launch(
        pipeline_checks.all_ranks,
        world_size=STAGES,
        args=(request.param,),
        timeout=300,
    )
    return request.param, results


def test_matches_one_device(ranks):
    _, results = ranks
    for result in results:
        assert result["weights"] <= 1e-5, result["rank"]
    last = results[-1]
    assert len(last["losses"]) == STEPS
    # Keras logs the mean of the steps' losses.
    assert sum(last["losses"]) / STEPS == pytest.approx(
        last["reference_losses"][0], rel=1e-5
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
    # One (BATCH / MICROBATCHES, 32) float32 activation per micro-batch
    # forward, and its gradient back.
    boundary = BATCH * 32 * 4
    assert first["sent"]["send"]["forward_bytes"] == boundary
    assert first["sent"]["send"]["backward_calls"] == 0
    assert last["sent"]["send"]["backward_bytes"] == boundary
    assert last["sent"]["send"]["forward_calls"] == 0
    for result in (first, last):
        assert result["sent"]["send"]["calls"] == MICROBATCHES


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
        # many as the stages after this one, plus its own.
        expected = MICROBATCHES if schedule == "gpipe" else STAGES - stage
        assert peak == expected, (stage, kinds)
