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
rank's part of its split axis, and only there.
"""

import keras
import numpy as np
from keras import ops

from keras_tp.plan import trace as tracing
from keras_tp.plan.comparing import as_numpy
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row


class _Reached(Exception):
    """Stops the run once the Row's input is known."""


def carries_rank_parts(model, trace, row, columns, tensor_parallel):
    """Whether raw ops carry `columns`' outputs to `row`'s input, each
    rank's part to that rank's part.

    Args:
        model: the traced model.
        trace: its `Trace`.
        row: the `Call` of the Row candidate.
        columns: the Column candidates' `Call`s, earlier than `row` in the
            same parent call.
        tensor_parallel: the number of ranks.

    Returns:
        `True` when the first rank's part of the Columns' outputs reaches
        the first rank's part of `row`'s input and nothing else of it, or
        when the run cannot tell (it raised); else `False`.
    """
    replaced = {column.index: column for column in columns}
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
            outputs = call(*args, **kwargs)
            if index in replaced:
                return _first_part_poisoned(layer, outputs, tensor_parallel)
            return outputs

        return poisoning_call

    try:
        with tracing.instrumented(model, wrap):
            if parent is None:
                model(trace.inputs, training=False)
            else:
                args, kwargs = parent.argument_values
                parent.layer.call(*args, **kwargs)
    except _Reached:
        pass
    except Exception:  # noqa: BLE001 - the pairing keeps its reading
        return True
    if not seen:
        return True
    poisoned = np.isnan(as_numpy(seen[0]).astype("float64"))
    axis = leaf_handler(row.layer).input_axis(row.layer, Row(), poisoned.ndim)
    first, rest = _parts(poisoned, axis, tensor_parallel)
    return bool(first.any()) and not rest.any()


def _parts(array, axis, tensor_parallel):
    """`(the first rank's part, the other ranks')` of `array` on `axis`."""
    width = array.shape[axis] // tensor_parallel
    return np.split(array, [width], axis=axis)


def _first_part_poisoned(layer, outputs, tensor_parallel):
    """`outputs` with the first rank's part of its split axis NaN."""
    flat = tracing.flat_tensors(outputs)
    if len(flat) != 1:
        return outputs
    value = as_numpy(flat[0])
    if not np.issubdtype(value.dtype, np.floating):
        return outputs
    axis = leaf_handler(layer).output_axis(layer, Column(), value.ndim)
    poisoned = value.copy()
    _parts(poisoned, axis, tensor_parallel)[0][...] = np.nan
    poisoned = ops.convert_to_tensor(poisoned, dtype=flat[0].dtype)
    return keras.tree.map_structure(
        lambda t: poisoned if t is flat[0] else t, outputs
    )
