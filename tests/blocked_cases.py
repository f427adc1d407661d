"""Fused projections laid out block by block, shared by every backend.

`zoo.fused` holds Swin's and ViTDet's query-key-value projection (one
`Dense(3 * dim)` reshaped to `(..., 3, heads, head_dim)`) and a SwiGLU
MLP's gate-and-up projection (one `Dense(2 * hidden)` split in halves).
Where the runtime stores blocked splits (`Runtime.stores_blocks`), they
pair with their Row as `Column(blocks=b)`: each rank holds its part of
each block, and costs Megatron's collectives. Elsewhere they gather.

The checks return plain numbers (a torch rank hands them back).
"""

import os

import keras
import numpy as np

import keras_tp
from tests import zoo
from tests import zoo_cases

# Per block of `zoo.fused`: its attention's and its MLP's Rows.
ROWS_PER_BLOCK = 2
BLOCKS = 2


def blocked_results(world_size, directory, swin=True):
    """Trains `zoo.fused` split `world_size` ways and round-trips its
    weights, its saved model and its checkpoint.

    Returns:
        `zoo_cases.measure`'s results of `"fused"`, and
        `"set_get"`: the largest difference of `get_weights()` after
        `set_weights(w)` from `w`; `"saved"`: of a model saved with
        `save()` and loaded by Keras from the split model's weights;
        `"plain"`: of a plain one-device model loaded from the split
        model's checkpoint, and `"plain_step"` of both after one more
        Adam step (which reads the loaded Adam state); `"split"`: of a
        split model loaded from it; `"swin"`: `measure`'s results of
        `"swin"`, where `swin`.
    """
    results = zoo_cases.measure("fused", world_size)
    model, x, y = zoo.fused()
    tp = keras_tp.TensorParallelKeras(model, world_size=world_size)
    _adam(tp)
    tp.train_on_batch(x, y)
    weights = tp.get_weights()
    tp.set_weights(weights)
    results["set_get"] = _largest(tp.get_weights(), weights)
    saved = os.path.join(directory, "fused.keras")
    tp.save(saved)
    results["saved"] = _largest(
        keras.saving.load_model(saved, compile=False).get_weights(), weights
    )
    checkpoint = os.path.join(directory, "checkpoint")
    keras_tp.save_checkpoint(tp, checkpoint, epoch=1)
    plain = _adam(zoo.fused()[0])
    keras_tp.load_checkpoint(plain, checkpoint)
    results["plain"] = _largest(plain.get_weights(), weights)
    tp.train_on_batch(x, y)
    plain.train_on_batch(x, y)
    results["plain_step"] = _largest(plain.get_weights(), tp.get_weights())
    split = keras_tp.TensorParallelKeras(zoo.fused()[0], world_size=world_size)
    _adam(split)
    keras_tp.load_checkpoint(split, checkpoint)
    results["split"] = _largest(split.get_weights(), weights)
    if swin:
        results["swin"] = zoo_cases.measure("swin", world_size)
    return results


def zero_results(directory, zero_stage=3):
    """`zoo.fused` at TP=2 x data 2 under ZeRO (slots and partitions of
    blocked variables): the largest differences from one device after 2
    steps (`"weights"`), and of a plain model loaded from its
    checkpoint from its `get_weights()` (`"plain"`). SGD with momentum:
    its slots are placed like the blocked variables, and unlike Adam it
    does not turn float noise on tiny gradients into steps of its rate."""
    reference, x, y = zoo.fused()
    _momentum(reference)
    tp = keras_tp.TensorParallelKeras(
        zoo.fused()[0], world_size=4, data_parallel=2, zero_stage=zero_stage
    )
    _momentum(tp)
    for _ in range(2):
        reference.train_on_batch(x, y)
        tp.train_on_batch(x, y)
    results = {
        "plan": {
            entry.layer.path: repr(entry.style)
            for entry in tp.sharding_plan.leaf_layers()
        },
        "weights": _largest(tp.get_weights(), reference.get_weights()),
    }
    checkpoint = os.path.join(directory, "zero")
    keras_tp.save_checkpoint(tp, checkpoint)
    plain = _momentum(zoo.fused()[0])
    keras_tp.load_checkpoint(plain, checkpoint)
    results["plain"] = _largest(plain.get_weights(), tp.get_weights())
    tp.train_on_batch(x, y)
    plain.train_on_batch(x, y)
    results["plain_step"] = _largest(plain.get_weights(), tp.get_weights())
    return results


def check_zero(results):
    """Blocked splits under ZeRO train as one device and round-trip."""
    assert results["plan"]["block_0/qkv"] == (
        "Column(gather_output=False, blocks=3)"
    ), results["plan"]
    assert results["weights"] <= 1e-5, results
    assert results["plain"] == 0.0, results
    assert results["plain_step"] <= 1e-5, results


def reshard_results(directory):
    """`zoo.fused_lora` (LoRA `b` factors split by blocks too) trained at
    TP=2, its checkpoint loaded at TP=4: the largest differences from
    one device (`"forward"`, and `"weights"` after 2 SGD steps), and of
    the TP=4 model's weights and output from the TP=2 model's
    (`"resharded"`, `"resharded_forward"`)."""
    reference, x, y = zoo.fused_lora()
    tp = keras_tp.TensorParallelKeras(zoo.fused_lora()[0], world_size=2)
    results = {"forward": _largest(tp(x), reference(x))}
    for model in (reference, tp):
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss=_loss())
        for _ in range(2):
            model.train_on_batch(x, y)
    results["weights"] = _largest(tp.get_weights(), reference.get_weights())
    results["plan"] = {
        e.layer.path: repr(e.style) for e in tp.sharding_plan.leaf_layers()
    }
    checkpoint = os.path.join(directory, "reshard")
    keras_tp.save_checkpoint(tp, checkpoint)
    wider = keras_tp.TensorParallelKeras(zoo.fused_lora()[0], world_size=4)
    wider.compile(optimizer=keras.optimizers.SGD(1e-2), loss=_loss())
    keras_tp.load_checkpoint(wider, checkpoint)
    results["resharded"] = _largest(wider.get_weights(), tp.get_weights())
    results["resharded_forward"] = _largest(wider(x), tp(x))
    return results


def check_reshard(results):
    assert results["plan"]["block_0/qkv"] == (
        "Column(gather_output=False, blocks=3)"
    ), results["plan"]
    assert results["forward"] <= 1e-5, results
    assert results["weights"] <= 1e-5, results
    assert results["resharded"] == 0.0, results
    assert results["resharded_forward"] <= 1e-5, results


USER_PLAN = {
    r"block_\d+/qkv/.*": keras_tp.Column(blocks=3),
    r"block_\d+/projection/.*": keras_tp.Row(),
    r"block_\d+/gate_up/.*": keras_tp.Column(blocks=2),
    r"block_\d+/down/.*": keras_tp.Row(),
}


def user_plan_results():
    """`USER_PLAN` at TP=2: the largest output difference from one
    device, and the refusal of pipeline stages (the error's text)."""
    reference, x, _ = zoo.fused()
    tp = keras_tp.TensorParallelKeras(
        zoo.fused()[0], world_size=2, plan=USER_PLAN
    )
    results = {"forward": _largest(tp(x), reference(x))}
    try:
        keras_tp.TensorParallelKeras(
            zoo.fused()[0], world_size=4, pipeline_parallel=2, plan=USER_PLAN
        )
        results["pipeline"] = None
    except keras_tp.ShardingError as error:
        results["pipeline"] = str(error)
    return results


def check_user_plan(results):
    assert results["forward"] <= 1e-5, results
    assert "cannot store yet" in (results["pipeline"] or ""), results


def pipeline_results():
    """`zoo.fused` in 2 pipeline stages of TP=2, whose stage storage does
    not split by blocks: its styles and the largest weight difference
    from one device after 2 SGD steps."""
    reference, x, y = zoo.fused()
    tp = keras_tp.TensorParallelKeras(
        zoo.fused()[0], world_size=4, pipeline_parallel=2
    )
    for model in (reference, tp):
        model.compile(optimizer=keras.optimizers.SGD(1e-2), loss=_loss())
        for _ in range(2):
            model.train_on_batch(x, y)
    return {
        "styles": sorted(
            {repr(e.style) for e in tp.sharding_plan.leaf_layers()}
        ),
        "weights": _largest(tp.get_weights(), reference.get_weights()),
    }


def check_pipeline(results):
    """Pipeline stages keep the fused projections gathering, exactly."""
    assert not any("blocks" in style for style in results["styles"]), results
    assert results["weights"] <= 1e-5, results


def check_blocked(results):
    """The fused projections pair as `Column(blocks=b)`, exactly, at
    Megatron's collectives, and round-trip their canonical weights."""
    zoo_cases.check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    plan = results["plan"]
    for index in range(BLOCKS):
        block = f"block_{index}/"
        assert plan[block + "qkv"] == "Column(gather_output=False, blocks=3)"
        assert plan[block + "gate_up"] == (
            "Column(gather_output=False, blocks=2)"
        )
        assert plan[block + "projection"] == repr(keras_tp.Row())
        assert plan[block + "down"] == repr(keras_tp.Row())
    reductions = BLOCKS * ROWS_PER_BLOCK
    collectives = results["collectives"]
    assert collectives["all_reduce"] == {
        "forward": reductions,
        "backward": reductions,
    }, collectives
    assert "all_gather" not in collectives, collectives
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    for key in ("set_get", "saved", "plain", "split"):
        assert results[key] == 0.0, (key, results[key])
    assert results["plain_step"] <= 1e-5, results["plain_step"]


def check_swin(results):
    """keras-hub's Swin, on every backend: its query-key-value projections
    pair by blocks with their output projections. Its window attention
    folds the heads back to the width it reads from its input's shape
    (`ops.reshape(x, (B_, N, C))`); a rank reads its part of that width
    (`keras_tp/plan/rank_widths.py`), which the plan's check confirms, so
    no layer falls back and the model trains exactly.

    Megatron's collectives: forward, one all-reduce per attention and per
    MLP, and one all-gather for each of the patch embedding and the patch
    merging (gathering Columns); backward, one all-reduce per attention and
    MLP input and one for the patch merging's input, and one all-gather per
    attention of its relative position bias table's gradient (a weight of
    its own per head, of which a rank reads its heads' slice).
    """
    zoo_cases.check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    blocked = repr(keras_tp.Column(gather_output=False, blocks=3))
    for stage in ("stage_0", "stage_1"):
        attention = f"{stage}/blocks_0/attn/"
        assert results["plan"][attention + "attention_qkv"] == blocked
        projection = results["plan"][attention + "attention_projection"]
        assert projection == repr(keras_tp.Row()), projection
    collectives = results["collectives"]
    assert collectives["all_reduce"] == {"forward": 4, "backward": 5}
    assert collectives["all_gather"] == {"forward": 2, "backward": 2}


def _adam(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_loss())
    return model


def _momentum(model):
    model.compile(
        optimizer=keras.optimizers.SGD(1e-2, momentum=0.9), loss=_loss()
    )
    return model


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _largest(a, b):
    a, b = keras.tree.flatten(a), keras.tree.flatten(b)
    assert len(a) == len(b), (len(a), len(b))
    return max(
        float(np.max(np.abs(_float64(x) - _float64(y)), initial=0.0))
        for x, y in zip(a, b)
    )


def _float64(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).astype("float64")
