"""Cutting a Functional model into pipeline stages: `split_stages`, on the
model's dataflow graph (`graph`, `cut_points`)."""

import logging

import keras

from keras_tp.errors import check_count
from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import overrides_compute_loss
from keras_tp.pipeline.cut_points import automatic_cuts
from keras_tp.pipeline.cut_points import candidate_cuts
from keras_tp.pipeline.cut_points import parameter_sizes
from keras_tp.pipeline.cut_points import user_cuts
from keras_tp.pipeline.graph import Dataflow
from keras_tp.pipeline.stages import Boundary
from keras_tp.pipeline.stages import BoundaryTensor
from keras_tp.pipeline.stages import Stage
from keras_tp.pipeline.stages import StageSplit
from keras_tp.runtime.base import median_seconds
from keras_tp.tensors import WithMask

logger = logging.getLogger(__name__)

# The name a Keras mask crosses a cut under: its tensor's, with this.
MASK_SUFFIX = "_keras_mask"

# Timed runs of each block for `balance="time"`, after one warm-up run.
TIMED_RUNS = 5

BALANCES = ("parameters", "time")


def split_stages(
    model, num_stages, cut_points=None, balance="parameters", sample=None
):
    """Cuts a Functional model into consecutive pipeline stages.

    Each stage is a Functional model of the user's own layers (the same
    variables); run one after the other, they compute what `model` does
    (`StageSplit.run`). A cut may fall between the calls of one layer (a
    token embedding that also computes a CausalLM's logits): each stage
    that calls it uses the weight (`StageSplit.shared_weights`), whose
    copies a pipeline keeps equal by adding up their gradients.

    Cut points are positions in a topological order of the model's layer
    and raw-op calls (the `x + y` of a residual add), nested models called
    once (a keras-hub backbone) opened up. Automatic cuts choose, where the
    fewest activations cross (carried inputs and outputs not counted), the
    `num_stages - 1` that make the largest stage smallest, then the stages
    most even. A tensor every block reads (T5's position bias) crosses
    every cut up to its last reader: pass `cut_points` inside its span.

    Args:
        model: a built Functional or Sequential Keras model.
        num_stages: number of stages, at least 1.
        cut_points: `None` for automatic cuts, or the names of the
            `num_stages - 1` layers (or ops, as `Stage.operation_names`
            lists them) at which new stages start, in the model's order.
        balance: what automatic cuts balance: `"parameters"` (weight
            scalars per stage), or `"time"` (each block's forward time on
            `sample`: the median of a few runs after a warm-up).
        sample: with `balance="time"`, a batch of the model's inputs.

    Returns:
        A `StageSplit`.

    Raises:
        NotImplementedError: for a subclassed model (its `call` is opaque).
        ValueError: for bad arguments, or a model with its own `compute_loss`.

    Example:

    ```python
    from keras_tp.pipeline import split_stages

    split = split_stages(backbone, num_stages=4)
    print(split.summary(sequence_length=1024))
    outputs = split.run(x)            # == backbone(x)
    sent = split.stages[0].model(x)
    # {"padding_mask": ..., "transformer_layer_5": ...}: the padding mask,
    # carried, and the residual stream after block 5.
    ```
    """
    check_count("num_stages", num_stages)
    if balance not in BALANCES:
        raise ValueError(
            f"Unknown balance {balance!r}; supported: "
            f"{', '.join(repr(b) for b in BALANCES)}."
        )
    if (balance == "time") != (sample is not None):
        raise ValueError(
            "balance='time' times the model's blocks on a batch of its "
            "inputs and needs one: pass sample=x with it (and only with "
            f"it); got balance={balance!r} and "
            f"sample={'None' if sample is None else 'a batch'}."
        )
    graph = Dataflow(model)
    if overrides_compute_loss(model):
        raise ValueError(
            f"Model '{model.name}' computes its loss in its own "
            f"`{type(model).__name__}.compute_loss`, which may call any "
            "stage; a pipeline's last stage computes each micro-batch's "
            "loss from the outputs with the loss given to compile(). Train "
            "this model without pipeline_parallel (tensor and data "
            "parallelism run its own loss)."
        )
    found = candidate_cuts(graph)
    if cut_points is None:
        if balance == "time" and num_stages > 1:
            sizes = block_seconds(graph, found[0], sample)
        else:
            sizes = parameter_sizes(graph)
        positions = automatic_cuts(graph, num_stages, sizes, found)
    else:
        positions = user_cuts(graph, num_stages, cut_points)
        balance = None
    split = _build(graph, positions, balance)
    split.candidate_cut_points = [graph.nodes[k].name for k in found[0]]
    logger.info("%s", split)
    return split


def block_seconds(graph, candidates, sample):
    """Forward seconds per node: each block's between the candidate cuts,
    measured on `sample`, at the block's first node."""
    blocks = _build(graph, candidates, None)
    seconds = [0.0] * len(graph.nodes)
    # Converted once, so that the first block's times do not include it.
    inputs = keras.tree.map_structure(keras.ops.convert_to_tensor, sample)
    for start, stage in zip([0, *candidates], blocks.stages):
        outputs = []

        def run(model=stage.model, inputs=inputs, outputs=outputs):
            outputs.append(model(inputs))
            # Backends may return before the outputs are computed.
            for tensor in keras.tree.flatten(outputs[-1]):
                keras.ops.convert_to_numpy(tensor)

        # The warm-up run's outputs feed the next block.
        seconds[start] = median_seconds(run, TIMED_RUNS)
        inputs = outputs[0]
    return seconds


def _build(graph, positions, balance):
    bounds = [0, *positions, len(graph.nodes)]
    crossings = [graph.crossing(k) for k in positions]
    stages, boundaries = [], []
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        nodes = graph.nodes[start:stop]
        values = {}
        if index == 0:
            for key in graph.inputs:
                tensor = graph.tensors[key].tensor
                values[key] = keras.Input(
                    batch_shape=tensor.shape,
                    dtype=tensor.dtype,
                    sparse=getattr(tensor, "sparse", False),
                    name=tensor.name,
                )
            flat = [values[key] for key in graph.inputs]
            inputs = keras.tree.pack_sequence_as(graph.input_structure, flat)
            input_names = [graph.tensors[key].name for key in graph.inputs]
        else:
            # The tensors sent across the cut before this stage: carried
            # where the sending stage did not make them.
            taken = {node.operation.name for node in nodes}
            inputs, sent = {}, []
            for key in crossings[index - 1]:
                info = graph.tensors[key]
                name = info.name + ("_received" if info.name in taken else "")
                shape = _batch_shape(info.tensor.shape)
                dtype = info.tensor.dtype
                inputs[name] = values[key] = keras.Input(
                    batch_shape=shape, dtype=dtype, name=name
                )
                carried = info.first <= bounds[index - 1]
                sent.append(BoundaryTensor(info.name, shape, dtype, carried))
                mask = get_keras_mask(info.tensor)
                if mask is not None:  # sent as integers beside its tensor
                    name = info.name + MASK_SUFFIX
                    shape = _batch_shape(mask.shape)
                    inputs[name] = keras.Input(
                        batch_shape=shape, dtype="int32", name=name
                    )
                    values[key] = WithMask()([values[key], inputs[name]])
                    sent.append(BoundaryTensor(name, shape, "int32", carried))
            boundaries.append(Boundary(index - 1, sent))
            input_names = list(inputs)
        for node in nodes:
            values.update(zip(node.outputs, node.replay(values.__getitem__)))
        if index == len(positions):
            flat = [values[key] for key in graph.outputs]
            outputs = keras.tree.pack_sequence_as(graph.output_structure, flat)
            output_names = [graph.tensors[key].name for key in graph.outputs]
        else:
            outputs = {}
            for key in crossings[index]:
                name = graph.tensors[key].name
                outputs[name] = values[key]
                if get_keras_mask(graph.tensors[key].tensor) is not None:
                    mask = get_keras_mask(values[key])  # made as there
                    outputs[name + MASK_SUFFIX] = keras.ops.cast(mask, "int32")
            output_names = list(outputs)
        stage_model = keras.Model(
            inputs=inputs,
            outputs=outputs,
            name=f"{graph.model.name}_stage_{index}",
        )
        stages.append(
            Stage(
                index=index,
                model=stage_model,
                layer_names=list(
                    dict.fromkeys(n.operation.name for n in nodes if n.is_layer)
                ),
                operation_names=[node.name for node in nodes],
                input_names=input_names,
                output_names=output_names,
                parameter_count=stage_model.count_params(),
            )
        )
    cut_points = [graph.nodes[k].name for k in positions]
    return StageSplit(graph.model, stages, boundaries, cut_points, balance)


def _batch_shape(shape):
    # Keras infers a batch of 1 where a batch-less tensor is broadcast
    # against a batched one.
    shape = tuple(shape)
    return (None,) + shape[1:] if shape else shape
