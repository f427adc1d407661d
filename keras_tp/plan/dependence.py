"""Whether a layer call's input is computed from other calls' outputs.

The trace does not record raw tensor ops (`trace.py`): a Row whose input
raw ops made may read its Column partners' outputs (an attention core
between the query and output projections) or not at all (RWKV's key
projection, which mixes the block's input with its shifted copy while
the receptance projection's output goes elsewhere). Pairing the second
kind would split a Row whose input is whole, and the code between the
layers would meet split values it never combines.

`reads_outputs_of` tells them apart by running the parent call again on
its recorded arguments with the Columns' outputs replaced by NaN: the
Row's input holds a NaN exactly when raw ops carried one of them to it.
"""

import keras
import numpy as np
from keras import ops

from keras_tp.plan import trace as tracing
from keras_tp.plan.comparing import as_numpy


class _Reached(Exception):
    """Stops the run once the Row's input is known."""


def reads_outputs_of(model, trace, row, columns):
    """Whether raw ops carry any of `columns`' outputs to `row`'s input.

    Args:
        model: the traced model.
        trace: its `Trace`.
        row: the `Call` of the Row candidate.
        columns: `Call`s of the same parent call, earlier than `row`.

    Returns:
        `False` when `row`'s first input holds none of their values; `True`
        when it does, or when the run cannot tell (it raised).
    """
    replaced = {column.index for column in columns}
    parent = None if row.parent is None else trace.calls[row.parent]
    # Call indices count from the parent's own call, which the run repeats.
    counter = [parent.index if parent else 0]
    seen = []

    def wrap(layer, call):
        def poisoning_call(*args, **kwargs):
            index = counter[0]
            counter[0] += 1
            if index == row.index:
                seen.append(tracing.flat_tensors((args, kwargs))[:1])
                raise _Reached
            outputs = call(*args, **kwargs)
            if index in replaced:
                return _poisoned(outputs)
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
    if not seen or not seen[0]:
        return True
    return bool(np.isnan(as_numpy(seen[0][0]).astype("float64")).any())


def _poisoned(outputs):
    def poison(value):
        dtype = getattr(value, "dtype", None)
        if tracing.is_tensor(value) and keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(dtype)
        ):
            return ops.full_like(value, float("nan"))
        return value

    return keras.tree.map_structure(poison, outputs)
