"""`TensorParallelKeras(sequence_parallel=True)` on torch: 2 and 4 processes.

Run alone:
`KERAS_BACKEND=torch python -m pytest tests/test_torch_sequence_parallel.py`.
One launch runs the checks of tensor parallelism alone (starting
processes is the slow part), another those with data parallelism. The
norms, dropouts and residual adds of keras-hub's decoder LMs run on
sequence shards (DTensors); they train exactly as on one device, with
Megatron's collectives, and the step's temporaries take less memory.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import zoo_cases  # noqa: E402
from tests.torch_scripts import sequence_checks  # noqa: E402

BLOCKS = zoo_cases.BLOCKS
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def results():
    return launch(
        sequence_checks.sequence_checks,
        world_size=WORLD_SIZE,
        args=(WORLD_SIZE,),
        timeout=900,
    )


def test_llama_trains_exactly_with_megatron_sp_collectives(results):
    llama = results["llama"]
    # Every weight that stays whole (Llama's 5 RMS norms) has its
    # gradient, a partial sum over each rank's shard, all-reduced once.
    assert llama["whole_weights"] == 2 * BLOCKS + 1
    # The backward pass gathers each region's input again (Megatron's
    # re-gather), rather than keeping it whole from the forward pass.
    zoo_cases.check_sequence_parallel(
        llama, llama["whole_weights"], regathered=True
    )


def test_composes_with_data_parallelism_and_zero():
    # 2 replicas of 2 tensor-parallel ranks, ZeRO-1 and ZeRO-3 over the
    # replicas: each replica's shards are DTensors of its own ranks. Under
    # ZeRO-3 a norm called on a shard reads its gathered weight as a
    # replicated DTensor, and the regions' inputs are still gathered
    # again for the backward pass.
    by_stage = launch(
        sequence_checks.data_parallel_checks,
        world_size=4,
        args=(2, WORLD_SIZE, (1, 3)),
        timeout=900,
    )
    assert sorted(by_stage) == [1, 3]
    for llama in by_stage.values():
        zoo_cases.check_sequence_parallel(
            llama, llama["whole_weights"], regathered=True
        )


def test_mixture_of_experts_trains_exactly(results):
    assert results["mixtral"] < 1e-5


def test_per_head_weights_train_or_refuse(results):
    # Qwen3 normalises each of a rank's heads with whole weights, whose
    # gradients the ranks sum: exact on shards, with nothing gathered.
    assert results["qwen3"]["weights"] < 1e-5
    assert not results["qwen3"]["fallbacks"]
    # Gemma's single key/value head stays whole and meets the shards in
    # its attention, which DTensor cannot run backward: refused.
    assert "no rule for them in torch" in results["gemma"]
    assert "sequence_parallel=False" in results["gemma"]


def test_dropout_on_shards_draws_the_whole_mask(results):
    # Each rank draws the mask of the whole sequence and keeps its shard:
    # the same masks as tensor parallelism alone.
    assert results["dropout"] < 1e-6


def test_activations_held_for_the_backward_pass_fall(results):
    # GPT2 (hidden 64, 2 heads, sequence 256) split 2 ways: Megatron's
    # activation formula, sbh(10 + 24/t + 5as/ht) per block for tensor
    # parallelism against sbh(34/t + 5as/ht), predicts 1.14x. Keeping the
    # region inputs gathered rather than their shards gives about 1.0x.
    (plain, _), (split, _) = (
        results["temporaries"][False],
        results["temporaries"][True],
    )
    assert plain > 1.1 * split, results["temporaries"]
