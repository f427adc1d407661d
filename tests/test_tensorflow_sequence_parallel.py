"""`TensorParallelKeras(sequence_parallel=True)` on TensorFlow, virtual CPUs.

Run alone:
`KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_sequence_parallel.py`. The norms, dropouts and
residual adds of keras-hub's decoder LMs run on sequence shards
(`SequenceShard`s) in each replica; they train exactly as on one device,
with Megatron's collectives, and the forward pass holds less for the
backward pass.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND") != "tensorflow":
    pytest.skip(
        "TensorFlow tests run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

import numpy as np  # noqa: E402

from benchmarks.sequence_parallel import tensorflow_held_bytes  # noqa: E402
from benchmarks.sequence_parallel import trained  # noqa: E402
from tests import models  # noqa: E402
from tests import zoo  # noqa: E402
from tests import zoo_cases  # noqa: E402

BLOCKS = zoo_cases.BLOCKS


def test_llama_trains_exactly_with_megatron_sp_collectives():
    llama = zoo_cases.sequence_parallel_results("llama", 2)
    # Every weight that stays whole (Llama's 5 RMS norms) has its
    # gradient, a partial sum over each replica's shard, all-reduced once.
    assert llama["whole_weights"] == 2 * BLOCKS + 1
    # The backward pass gathers each region's input again (Megatron's
    # re-gather), rather than keeping it whole from the forward pass.
    zoo_cases.check_sequence_parallel(
        llama, llama["whole_weights"], regathered=True
    )


@pytest.mark.parametrize("name", ["gpt2", "gemma", "qwen3"])
def test_decoder_lms_train_exactly(name):
    # GPT2 adds a position table to the shards, Gemma keeps its single
    # key/value head whole and Qwen3 normalises each head with whole
    # weights: what meets a shard whole is sliced or gathered, what
    # computes on a replica's heads sums its gradients, and stays exact.
    reference, tp = zoo_cases.trained(name, 2, sequence_parallel=True)
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5


def test_calls_predict_and_evaluate_match_one_device():
    reference, tp, x, y = zoo_cases.pair("gpt2", 2, sequence_parallel=True)
    assert models.max_diff(tp(x), reference(x)) < 1e-5
    for model in (reference, tp):
        model.compile(optimizer="sgd", loss=zoo.loss_for("gpt2"))
    predicted = tp.predict(x, batch_size=len(y), verbose=0)
    assert models.max_diff(predicted, reference(x)) < 1e-5
    assert np.allclose(
        tp.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0)
    )


def test_dropout_on_shards_draws_the_whole_mask():
    # Each replica draws the mask of the whole sequence and keeps its
    # shard: the same masks as tensor parallelism alone.
    assert zoo_cases.dropout_difference(2) < 1e-6


def test_activations_held_for_the_backward_pass_fall():
    # GPT2 (hidden 128, 4 heads, sequence 128, batch 2) split 4 ways: the
    # forward pass leaves 4.1 MiB per device for the backward pass with
    # tensor parallelism alone, 2.9 MiB with the shards (1.4x; Megatron's
    # activation formula predicts 1.5x, TensorFlow's GELU keeps more of
    # the split layers' activations than it counts). Keeping the regions'
    # gathered inputs rather than re-gathering them gives 1.24x.
    held = {
        sequence: tensorflow_held_bytes(
            *trained(128, 128, 4, BLOCKS, 2, 4, sequence)
        )
        for sequence in (False, True)
    }
    assert held[False] > 1.3 * held[True], held


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_composes_with_data_parallelism_and_zero(zero_stage):
    # 2 replicas of 2 tensor-parallel ranks: each replica's shards are
    # split over its own ranks, the data axis' collectives are ZeRO's.
    llama = zoo_cases.sequence_parallel_results(
        "llama", 4, data_parallel=2, zero_stage=zero_stage
    )
    zoo_cases.check_sequence_parallel(
        llama, llama["whole_weights"], regathered=True
    )


def test_lengths_that_do_not_divide_are_refused():
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(), world_size=4, sequence_parallel=True
    )
    x, _ = models.backbone_data(2, length=6)
    with pytest.raises(ValueError, match="must divide by 4"):
        tp(x)


def test_batches_of_different_lengths_are_refused():
    # Keras traces the step again for a second length with the length
    # unknown, which the shards cannot split.
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(length=8), world_size=2, sequence_parallel=True
    )
    tp.compile(optimizer="sgd", loss="mse")
    tp.train_on_batch(*models.backbone_data(2, length=4))
    with pytest.raises(ValueError, match="Pad every batch to one sequence"):
        tp.train_on_batch(*models.backbone_data(2, length=6))


def test_shards_compute_as_whole_tensors():
    # On shards: pointwise operations with whole tensors (sliced where
    # they have the sequence axis), comparisons, reductions over the
    # features; what has no rule (a `where`, a pooling over the
    # sequence) gathers them, of any dtype. Each result is the whole
    # tensors' result.
    import tensorflow as tf

    from keras_tp.collectives import tensorflow_sequence
    from keras_tp.collectives.tensorflow import TensorFlowCollectiveAdapter

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    adapter = TensorFlowCollectiveAdapter(axis_size=2)
    x = tf.reshape(tf.range(2 * 4 * 3, dtype=tf.float32), (2, 4, 3))
    mask = tf.cast(tf.reshape(tf.range(8), (2, 4, 1)) > 3, tf.float32)

    def compute(x):
        scaled = tf.where(x > 1.0, x * mask + 1.0, 0.0) / 2.0
        centred = scaled - tf.reduce_mean(scaled, axis=-1, keepdims=True)
        return centred, tf.reduce_mean(centred, axis=1), x >= 5.0

    def replica():
        with tensorflow_sequence.shards_of(adapter):
            rank = adapter.rank()
            shard = tensorflow_sequence.SequenceShard(
                local=x[:, 2 * rank : 2 * rank + 2], length=4
            )
            return tensorflow_sequence.whole_tensors(compute(shard))

    results = tf.function(lambda: strategy.run(replica))()
    for result, expected in zip(results, compute(x)):
        for local in strategy.experimental_local_results(result):
            np.testing.assert_array_equal(local, expected)


def test_a_shard_outside_its_step_is_refused():
    import tensorflow as tf

    from keras_tp.collectives import tensorflow_sequence

    shard = tensorflow_sequence.SequenceShard(
        local=tf.zeros((2, 2, 3)), length=4
    )
    with pytest.raises(RuntimeError, match="outside the replica step"):
        tensorflow_sequence.whole_tensor(shard)
