"""Run on every rank by `keras_tp.launch` in
tests/test_torch_sequence_parallel.py."""

from benchmarks.sequence_parallel import step_temporary_bytes
from benchmarks.sequence_parallel import trained
from tests import models
from tests import zoo_cases


def sequence_checks(world_size):
    """Rank 0's results of each check of the test module."""
    results = {
        name: zoo_cases.sequence_parallel_results(name, world_size)
        for name in ("llama",)
    }
    reference, tp = zoo_cases.trained(
        "qwen3", world_size, sequence_parallel=True
    )
    results["qwen3"] = {
        "weights": models.max_diff(tp.get_weights(), reference.get_weights()),
        "fallbacks": dict(tp.sharding_plan.fallbacks),
    }
    # Mixtral's experts run on the flattened tokens, which DTensor makes
    # from the shards, and reduce their outputs whole.
    reference, tp = zoo_cases.trained(
        "mixtral", world_size, sequence_parallel=True
    )
    results["mixtral"] = models.max_diff(
        tp.get_weights(), reference.get_weights()
    )
    results["gemma"] = _refusal("gemma", world_size)
    results["dropout"] = zoo_cases.dropout_difference(world_size)
    results["temporaries"] = {
        sequence: step_temporary_bytes(
            *trained(256, 64, 2, 2, 2, world_size, sequence)
        )
        for sequence in (False, True)
    }
    return results


def data_parallel_checks(data_parallel, tensor_parallel, zero_stages):
    """Rank 0's Llama results (`zoo_cases.sequence_parallel_results`) with
    `data_parallel` replicas of `tensor_parallel` ranks, by ZeRO stage of
    `zero_stages` (one launch for all: starting processes is slow)."""
    return {
        stage: zoo_cases.sequence_parallel_results(
            "llama",
            data_parallel * tensor_parallel,
            data_parallel=data_parallel,
            zero_stage=stage,
        )
        for stage in zero_stages
    }


def _refusal(name, world_size):
    """The error of zoo model `name`'s first training step, or `None`."""
    _, tp, x, y = zoo_cases.pair(name, world_size, sequence_parallel=True)
    tp.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    try:
        tp.train_on_batch(x, y)
    except ValueError as error:
        return str(error)
    return None
