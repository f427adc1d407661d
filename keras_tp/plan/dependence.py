"""Whether raw ops carry each rank's part of Column outputs to a Row.

The trace does not record raw tensor ops (`trace.py`). A Row whose input
raw ops made may read its Column partners' outputs with each rank's
features kept apart (an attention core between the query and output
projections), read none of them (RWKV's key projection, which mixes the
block's input with its shifted copy while the receptance projection's
output goes elsewhere), or mix the ranks' features (FNet's Fourier
transform over the features; a projection fused block by block, whose
contiguous slice is not one rank's heads). Only the first is a Megatron
pair: in the others a rank's slice is not what the code between the
layers needs, and XLA, on global arrays, would move data to make it so,
outside the plan's collectives.

`carries_rank_parts` tells them apart by running the parent call again
on its recorded arguments with the first rank's part of each Column
output replaced by NaN: the Row's input must then hold NaN in the first
rank's part of its split axis, and only there. The same run, with the
first rank's part of one of the call's arguments NaN instead, tells
whether raw ops carry that argument into the split features
(`argument_carries_rank_parts`).
"""

import keras
import numpy as np
from keras import ops

from keras_tp.blocks import stored_order
from keras_tp.plan import trace as tracing
from keras_tp.plan.comparing import as_numpy
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row


class _Reached(Exception):
    """Stops the run once the Row's input is known."""


def carries_rank_parts(
    model, trace, row, columns, tensor_parallel, blocks=None
):
    """Whether raw ops carry `columns`' outputs to `row`'s input, each
    rank's part to that rank's part.

    With `blocks`, a Column's output holds that many blocks side by side
    (a fused projection laid out block by block), and its first rank's
    part is the first rank's slice of each block.

    Args:
        model: the traced model.
        trace: its `Trace`.
        row: the `Call` of the Row candidate.
        columns: the Column candidates' `Call`s, earlier than `row` in the
            same parent call.
        tensor_parallel: the number of ranks.
        blocks: `{Column call index: blocks}`; default one block each.

    Returns:
        `True` when the first rank's part of the Columns' outputs reaches
        the first rank's part of `row`'s input and nothing else of it, or
        when the run cannot tell (it raised); else `False`.
    """
    replaced = {column.index for column in columns}

    def poisoned_output(index, layer, outputs):
        if index not in replaced:
            return outputs
        count = (blocks or {}).get(index, 1)
        return _first_part_poisoned(layer, outputs, tensor_parallel, count)

    seen = _row_input(model, trace, row, poisoned_output)
    if seen is None:
        return True
    return _first_part_only(seen, row, tensor_parallel)


def argument_carries_rank_parts(
    model, trace, row, position, axis, tensor_parallel
):
    """Whether raw ops carry an input of `row`'s parent call, split on
    `axis`, to `row`'s input, each rank's part to that rank's part: a
    whole argument multiplied into split features (Gemma3n's per-layer
    input, which its block multiplies into its gate's output before the
    projection back).

    Args:
        model: the traced model.
        trace: its `Trace`.
        row: the `Call` of a Row, inside a layer's call (not the model's).
        position: the index of the tensor in the parent call's `inputs`.
        axis: the axis of that tensor to split.
        tensor_parallel: the number of ranks.

    Returns:
        `True` when the first rank's part of the tensor reaches the first
        rank's part of `row`'s input and nothing else of it; `False`
        otherwise, or when the run raised.
    """
    parent = trace.calls[row.parent]
    # The value as the call received it (torch may change it in place).
    value = parent.input_values[position]
    poisoned = as_numpy(value).astype("float64")
    _parts(poisoned, axis, tensor_parallel)[0][...] = np.nan
    poisoned = ops.convert_to_tensor(poisoned, dtype=value.dtype)
    arguments = parent.arguments_with({position: poisoned})
    seen = _row_input(model, trace, row, lambda i, layer, out: out, arguments)
    return seen is not None and _first_part_only(seen, row, tensor_parallel)


def _row_input(model, trace, row, output_of, arguments=None):
    """The input `row`'s call receives when its parent call (`model`'s
    call at the top) runs again on `arguments` (default: as recorded),
    each inner call's outputs passed through `output_of(index, layer,
    outputs)`; `None` where the run raised or never reached `row`."""
    parent = None if row.parent is None else trace.calls[row.parent]
    # Call indices count from the parent's own call, which the run repeats.
    counter = [parent.index if parent else 0]
    seen = []

    def wrap(layer, call):
        def poisoning_call(*args, **kwargs):
            index = counter[0]
            counter[0] += 1
            if index == row.index:
                seen.extend(tracing.flat_tensors((args, kwargs))[:1])
                raise _Reached
            return output_of(index, layer, call(*args, **kwargs))

        return poisoning_call

    try:
        with tracing.instrumented(model, wrap):
            if parent is None:
                model(trace.inputs, training=False)
            else:
                args, kwargs = arguments or parent.argument_values
                parent.layer.call(*args, **kwargs)
    except _Reached:
        pass
    except Exception:  # noqa: BLE001 - the caller says what not knowing means
        return None
    return seen[0] if seen else None


def _first_part_only(row_input, row, tensor_parallel):
    """Whether `row_input` is NaN in the first rank's part of the Row's
    split axis, and only there."""
    poisoned = np.isnan(as_numpy(row_input).astype("float64"))
    axis = leaf_handler(row.layer).input_axis(row.layer, Row(), poisoned.ndim)
    first, rest = _parts(poisoned, axis, tensor_parallel)
    return bool(first.any()) and not rest.any()


def _parts(array, axis, tensor_parallel):
    """`(the first rank's part, the other ranks')` of `array` on `axis`."""
    width = array.shape[axis] // tensor_parallel
    return np.split(array, [width], axis=axis)


def _first_part_poisoned(layer, outputs, tensor_parallel, blocks=1):
    """`outputs` with the first rank's part of its split axis NaN: the
    first rank's slice of each of its `blocks` blocks."""
    flat = tracing.flat_tensors(outputs)
    if len(flat) != 1:
        return outputs
    value = as_numpy(flat[0])
    if not np.issubdtype(value.dtype, np.floating):
        return outputs
    axis = leaf_handler(layer).output_axis(layer, Column(), value.ndim)
    size = value.shape[axis]
    first = stored_order(size, tensor_parallel, blocks)[
        : size // tensor_parallel
    ]
    mask = np.zeros(size, bool)
    mask[first] = True
    mask = mask.reshape([-1 if i == axis else 1 for i in range(value.ndim)])
    poisoned = np.where(mask, np.nan, value).astype(value.dtype)
    poisoned = ops.convert_to_tensor(poisoned, dtype=flat[0].dtype)
    return keras.tree.map_structure(
        lambda t: poisoned if t is flat[0] else t, outputs
    )
