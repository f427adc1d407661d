"""Tensor parallelism on the PyTorch backend: 2 processes over gloo.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch.py -q`.

Starting processes is slow on a small CPU machine, so each launch serves
many assertions: one launch per model (forward, gradients, Adam steps,
collectives, memory), one for the weights/saving/collectives API, and one
per launch failure mode. The oracle is the same model built with the same
seed in one process.
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402
from keras_tp.launcher import RankError  # noqa: E402
from keras_tp.launcher import RankTimeoutError  # noqa: E402
from keras_tp.launcher import RemoteTraceback  # noqa: E402
from keras_tp.launcher import launch  # noqa: E402
from tests import generation_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import output_cases  # noqa: E402
from tests import own_loss_cases  # noqa: E402
from tests import random_cases  # noqa: E402
from tests import regularizer_cases  # noqa: E402
from tests import vocab_cases  # noqa: E402
from tests.torch_scripts import rank_checks  # noqa: E402

WORLD_SIZE = 2
TOLERANCE = 1e-5
ADAM_TOLERANCE = 2e-5
LAUNCH_TIMEOUT = 300
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

_model_runs = {}


def model_run(name):
    """Per-rank results of `rank_checks.model_checks(name)`, launched once."""
    if name not in _model_runs:
        _model_runs[name] = launch(
            rank_checks.model_checks,
            world_size=WORLD_SIZE,
            args=(name,),
            timeout=LAUNCH_TIMEOUT,
        )
    return _model_runs[name]


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("saved") / "transformer_lm.keras")
    ranks = launch(
        rank_checks.api_checks,
        world_size=WORLD_SIZE,
        args=(path,),
        timeout=LAUNCH_TIMEOUT,
    )
    return path, ranks


MODELS = list(models.BUILDERS)


@pytest.mark.parametrize("name", MODELS)
def test_forward_matches_one_device(name):
    for rank in model_run(name):
        assert rank["forward"] <= TOLERANCE, rank["rank"]


@pytest.mark.parametrize("name", MODELS)
def test_gradients_match_one_device(name):
    for rank in model_run(name):
        assert rank["gradient"] <= TOLERANCE, rank["rank"]
        if "input_gradient" in rank:
            assert rank["input_gradient"] <= TOLERANCE, rank["rank"]


@pytest.mark.parametrize("name", MODELS)
def test_gradients_are_not_world_size_times_too_large(name):
    # Each rank's local gradient, against its slice of the one-device
    # gradient, by norm: an all-reduce too many would give 2.0.
    for rank in model_run(name):
        ratios = list(rank["gradient_norm_ratios"].values())
        ratios.append(rank.get("input_gradient_ratio", 1.0))
        assert len(ratios) > 2
        np.testing.assert_allclose(ratios, 1.0, atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_adam_steps_match_one_device(name):
    for rank in model_run(name):
        assert rank["steps"] == 5
        np.testing.assert_allclose(
            rank["losses"], rank["reference_losses"], rtol=1e-5
        )
        # Adam turns float noise on near-zero gradients into steps of up
        # to lr: 5 steps at lr 1e-3 leave the transformer 1.1e-5 apart.
        assert rank["weights"] <= ADAM_TOLERANCE, rank["rank"]


@pytest.mark.parametrize("name", MODELS)
def test_memory_holds_only_local_shards(name):
    for rank in model_run(name):
        memory = rank["memory"]
        device = f"cpu:{rank['rank']}"
        assert memory["split_variables"] > 0
        # Measured from every tensor reachable from the model and the
        # optimizer: variables, gradients, Adam slots, anything else.
        assert memory["measured"] <= 1.01 * memory["budget"], memory
        assert memory["measured"] < memory["sharded"] + memory["replicated"]
        assert memory["parameter_bytes"] == {
            device: memory["local_variable_bytes"]
        }
        assert (
            memory["optimizer_bytes"][device]
            > memory["parameter_bytes"][device]
        )


@pytest.mark.parametrize("name", MODELS)
def test_collectives_are_recorded_per_step(name):
    for rank in model_run(name):
        stats = rank["train_stats"]
        assert stats["all_reduce"]["forward_calls"] >= 1
        # Eager torch records every step anew: the next step counts the same.
        assert rank["train_stats_again"] == stats


def test_transformer_collectives_per_block():
    blocks = 2
    for rank in model_run("transformer_lm"):
        stats = rank["train_stats"]
        # Per block one all-reduce after attention and one after the MLP,
        # forward and backward; plus the token and position embeddings
        # forward and the lm head's input backward. The lm head's logits
        # stay split by vocabulary for the loss, which all-reduces one
        # float per token twice; nothing is gathered.
        assert stats["all_reduce"]["forward_calls"] == 2 * blocks + 4
        assert stats["all_reduce"]["backward_calls"] == 2 * blocks + 1
        assert set(stats) == {"all_reduce"}
        # A direct call returns the logits whole.
        call = rank["forward_call_stats"]
        assert call["all_reduce"]["forward_calls"] == 2 * blocks + 2
        assert call["all_reduce"]["backward_calls"] == 0
        assert call["all_gather"]["forward_calls"] == 1


def test_vocab_parallel_loss_matches_one_device(api_run):
    _, ranks = api_run
    for rank in ranks:
        vocab_cases.check_runs(rank["vocab_parallel"])
        # Measured from the tensors each rank's step creates
        # (`benchmarks/vocab_parallel.py --backend torch`).
        vocab_cases.check_step_memory(rank["vocab_memory"], WORLD_SIZE)


def test_generation_matches_one_device(api_run):
    _, ranks = api_run
    for rank in ranks:
        generation_cases.check_runs(rank["generation"], WORLD_SIZE)


def test_a_tensor_returned_twice_trains_as_on_one_device(api_run):
    _, ranks = api_run
    for rank in ranks:
        for run in rank["twice_returned"]:  # split, then two stages
            output_cases.check_runs(run)


def test_a_models_own_compute_loss_trains_as_on_one_device(api_run):
    _, ranks = api_run
    for rank in ranks:
        own_loss_cases.check_runs(rank["own_loss"])


def test_regularized_split_layers_report_one_devices_loss(api_run):
    _, ranks = api_run
    for rank in ranks:
        regularizer_cases.check_runs(rank["regularizers"])


def test_get_weights_are_full_and_match(api_run):
    _, ranks = api_run
    for rank in ranks:
        assert rank["get_weights_shapes_match"]
        assert rank["get_weights"] == 0.0


def test_set_weights_round_trip(api_run):
    _, ranks = api_run
    for rank in ranks:
        assert "set_weights_error" not in rank, rank["set_weights_error"]
        assert rank["set_get_weights"] == 0.0
        assert rank["set_weights_forward"] <= TOLERANCE
        assert rank["local_shapes_after_set"]


def test_saved_model_loads_in_plain_keras(api_run):
    path, ranks = api_run
    assert ranks[0]["saved_predictions"] <= TOLERANCE
    assert ranks[0]["saved_weights"] == 0.0
    # In this process: plain Keras, no process group, no keras_tp.
    loaded = keras.saving.load_model(path)
    x, _ = models.data_for("transformer_lm")
    predictions = keras.ops.convert_to_numpy(loaded.predict(x, verbose=0))
    np.testing.assert_allclose(
        predictions, ranks[0]["reference_predictions"], atol=TOLERANCE
    )


def test_save_restores_the_shards(api_run):
    _, ranks = api_run
    for rank in ranks:
        assert rank["forward_after_save"] <= TOLERANCE
        assert set(rank["shards_after_save"]) == {f"cpu:{rank['rank']}"}


def test_dropout_masks_per_split_part_and_alike_where_whole(api_run):
    _, ranks = api_run
    random_cases.check_masks(ranks[0]["masks"])
    random_cases.check_same_on_every_rank([r["masks"] for r in ranks])


def test_parallelism_info(api_run):
    _, ranks = api_run
    assert ranks[0]["info"] == {
        "backend": "torch",
        "world_size": 2,
        "tensor_parallel": 2,
        "devices": ["cpu:0", "cpu:1"],
    }


def test_raw_collectives(api_run):
    _, ranks = api_run
    for r, rank in enumerate(ranks):
        checks = dict(rank["collectives"])
        assert (checks.pop("rank"), checks.pop("size")) == (r, WORLD_SIZE)
        assert checks == {k: 0.0 for k in checks}
        assert "reduce_from_parallel" in rank["raw_collective_grad_error"]


def test_conjugate_operators_have_exact_gradients(api_run):
    _, ranks = api_run
    for rank in ranks:
        checks = rank["conjugate"]
        assert checks["copy_reduce"] == 0.0
        assert checks["scatter_gather_forward"] == 0.0
        assert checks["scatter_gather_grad"] == 0.0
        # The trap this adapter avoids, measured: torch.distributed.nn's
        # all_reduce gives world_size times the gradient.
        assert checks["naive_ratio"] == pytest.approx(WORLD_SIZE)


def test_bad_world_size_and_plan_errors(api_run):
    _, ranks = api_run
    for rank in ranks:
        assert "world_size=4" in rank["world_size_error"]
        assert "2 rank(s)" in rank["world_size_error"]
        message = rank["row_input_error"]
        assert "Layer 'up'" in message
        assert "8 of 16 features" in message
        assert "Row(input_is_parallel=False)" in message


def test_unlaunched_process_cannot_use_two_ranks():
    with pytest.raises(RuntimeError, match="keras_tp.launch") as error:
        keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    assert "torchrun --nproc-per-node 2" in str(error.value)


def test_launch_reraises_a_rank_exception_with_its_traceback():
    with pytest.raises(ValueError, match="boom on rank 1") as error:
        launch(rank_checks.raise_on_rank, world_size=2, args=(1,), timeout=120)
    cause = error.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in raise_on_rank" in str(cause)
    assert "raised on rank 1" in error.value.__notes__[0]


def test_launch_names_a_dead_rank():
    with pytest.raises(RankError, match=r"Rank 1 \(pid \d+\) died") as error:
        launch(rank_checks.die_on_rank, world_size=2, args=(1,), timeout=120)
    assert "exit code 3" in str(error.value)


def test_launch_times_out_naming_the_hung_rank():
    # Rank 0 returns at once; the machine waits out the timeout idle.
    timeout = 15
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match="timed out after 15") as error:
        launch(
            rank_checks.hang_on_rank, world_size=2, args=(1,), timeout=timeout
        )
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert "rank(s) 1 still running" in message
    assert "finished: [0]" in message
    # The hung rank's stack, dumped before it was stopped.
    assert "-- Rank 1 was at:" in message
    assert "hang_on_rank" in message
    assert elapsed < timeout + 15


def test_launch_calls_the_function_in_process_on_jax():
    code = (
        "import os\n"
        "from keras_tp.launcher import launch\n"
        "assert launch(os.getpid, world_size=4) == os.getpid()\n"
        "print('in-process')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in-process" in result.stdout


def test_torchrun_smoke(tmp_path):
    from tests.torch_scripts import train_smoke

    out = tmp_path / "losses.json"
    script = os.path.join(TESTS, "torch_scripts", "train_smoke.py")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            script,
            str(out),
        ],
        env={
            **os.environ,
            "KERAS_BACKEND": "torch",
            "PYTHONPATH": ROOT,
        },
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["info"]["world_size"] == 2
    one_device = train_smoke.train(models.mlp())
    assert len(report["losses"]) == train_smoke.EPOCHS
    np.testing.assert_allclose(report["losses"], one_device, rtol=1e-5)
