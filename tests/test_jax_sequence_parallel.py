"""`TensorParallelKeras(sequence_parallel=True)` on JAX, virtual CPU devices.

Run alone:
`KERAS_BACKEND=jax python -m pytest tests/test_jax_sequence_parallel.py`.
keras-hub's decoder LMs train exactly as on one device with their norms,
dropouts and residual adds on sequence shards; every all-reduce of tensor
parallelism becomes a reduce-scatter and an all-gather of the same bytes,
in the counters and in the compiled HLO; the compiled step's activations
take less memory.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)


from benchmarks.jax_steps import hlo_collectives  # noqa: E402
from benchmarks.jax_steps import step_memory  # noqa: E402
from benchmarks.sequence_parallel import step_of  # noqa: E402
from tests import models  # noqa: E402
from tests import zoo_cases  # noqa: E402

BLOCKS = zoo_cases.BLOCKS


# GPT2 is the compiled-step test's model; torch's test trains Qwen3.
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_decoder_lms_train_exactly_with_megatron_sp_collectives(name):
    # XLA sums the whole weights' gradients itself, uncounted (see below).
    zoo_cases.check_sequence_parallel(
        zoo_cases.sequence_parallel_results(name, 2),
        whole_weight_reductions=0,
        regathered=False,
    )


def test_mixture_of_experts_trains_exactly():
    # Mixtral's experts run on the flattened tokens, which have no
    # sequence axis: they reduce their outputs whole.
    reference, tp = zoo_cases.trained("mixtral", 2, sequence_parallel=True)
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5


def _gpt2_step(sequence_parallel):
    """A GPT2 backbone (hidden 128, 4 heads) split 4 ways, and its compiled
    training step on sequences of 128."""
    return step_of(
        length=128,
        hidden=128,
        heads=4,
        layers=BLOCKS,
        batch=2,
        tensor_parallel=4,
        sequence=sequence_parallel,
    )


def test_compiled_step_runs_the_counted_collectives_in_less_memory():
    tp, compiled = _gpt2_step(sequence_parallel=True)
    _, plain = _gpt2_step(sequence_parallel=False)
    counted = tp.communication_stats(axis="model")
    hlo = hlo_collectives(compiled)
    for kind in ("all_gather", "reduce_scatter"):
        assert hlo[kind.replace("_", "-")]["ops"] == counted[kind]["calls"]
    # XLA sums the gradients of the weights that stay whole (norms, biases
    # after a reduce-scatter, the position table), each computed on a
    # sequence shard, in one all-reduce: Megatron's all-reduce of its
    # sequence-parallel parameters.
    whole = [
        v
        for v in tp.trainable_variables
        if tp._runtime.placement.split_axis(v) is None
    ]
    assert hlo["all-reduce"] == {"ops": 1, "tensors": len(whole)}
    assert "all_reduce" not in counted
    activations = step_memory(compiled)["temporaries"]
    assert step_memory(plain)["temporaries"] > 1.3 * activations


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="or use torch, or JAX with"):
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=4, data_parallel=2, sequence_parallel=True
        )
    with pytest.raises(ValueError, match="or data_parallel=1 on JAX"):
        keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=4,
            pipeline_parallel=2,
            data_parallel=2,
            sequence_parallel=True,
        )
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(), world_size=4, sequence_parallel=True
    )
    x, _ = models.backbone_data(2, length=6)
    with pytest.raises(ValueError, match="must divide by 4"):
        tp(x)


def test_a_model_without_a_sequence_axis_warns_with_the_fix():
    with pytest.warns(UserWarning) as caught:
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=2, sequence_parallel=True
        )
    (warning,) = [w for w in caught if "sequence_parallel" in str(w.message)]
    assert "model 'mlp'" in str(warning.message)
    assert "[(None, 16)]" in str(warning.message)
    assert "pass sequence_parallel=False" in str(warning.message)
    assert warning.filename == __file__  # the wrapping line, not keras_tp
