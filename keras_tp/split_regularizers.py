"""Regularizers of split weights and outputs: one device's penalty on
every rank.

Where ranks hold their own slices (torch, JAX with a data axis), Keras
computes a split weight's regularizer (a layer's `kernel_regularizer`) on
the rank's slice, so the loss a step reports would hold that rank's part
of the penalty only. Keras' `L1`, `L2` and `L1L2` penalties are sums over
the entries: each rank's penalty of its slice is summed over the ranks
(`reduce_from_parallel`: all-reduce forward, the gradient unchanged, so
each slice gets its own). Any other regularizer (`OrthogonalRegularizer`,
one of the user's) reads the whole weight, gathered
(`gather_from_parallel`: the rank keeps its slice of the gradient).

A layer's `activity_regularizer` penalises its output, which Keras adds
after the layer's call; where the output leaves the call split (a Column
that does not gather), the ranks' penalties are summed as the weights'
are. Another activity regularizer on a split output is refused.
"""

import keras

from keras_tp.errors import ShardingError
from keras_tp.regions import set_call

# Regularizers whose penalty of a weight is the sum of its slices'.
_SUMS_OVER_ENTRIES = (
    keras.regularizers.L1,
    keras.regularizers.L2,
    keras.regularizers.L1L2,
)


def install(plan, runtime):
    """Makes the regularizers of `plan`'s split variables give the whole
    weight's penalty where `runtime`'s ranks hold their own slices."""
    for variable, axis in plan.split_variables():
        if variable.regularizer is not None:
            variable.regularizer = _whole_penalty(
                variable.regularizer, axis, runtime
            )
    for entry in plan.leaf_layers():
        if entry.layer.activity_regularizer is not None:
            _sum_activity_penalty(entry, runtime)


def check_unpartitioned(variable):
    """Refuses a regularizer on `variable`, which ZeRO-3 partitions over
    the data-parallel rows: each would penalise its partition."""
    if variable.regularizer is not None:
        raise ValueError(
            f"Variable '{variable.path}' has a regularizer and "
            "zero_stage=3 partitions it over the data-parallel rows, which "
            "would each penalise their partition. Use zero_stage=1 or 2, "
            "or AdamW's weight_decay instead of the regularizer."
        )


def _whole_penalty(regularizer, axis, runtime):
    sums = type(regularizer) in _SUMS_OVER_ENTRIES

    def penalty(value):
        if not runtime.holds_local_values():
            return regularizer(value)
        adapter = runtime.adapter
        if sums:
            return adapter.reduce_from_parallel(regularizer(value))
        # Keras passes the variable itself outside a stateless scope.
        value = keras.ops.convert_to_tensor(value)
        return regularizer(adapter.gather_from_parallel(value, axis))

    return penalty


def _sum_activity_penalty(entry, runtime):
    """Sums over the ranks the activity penalty Keras adds after `entry`'s
    layer returns a split output, through the layer's `add_loss` (losses
    its own call adds are left as they are)."""
    layer, call, add_loss = entry.layer, entry.layer.call, entry.layer.add_loss
    sums = type(layer.activity_regularizer) in _SUMS_OVER_ENTRIES
    returned_split = [False]

    def penalised_call(*args, **kwargs):
        returned_split[0] = False
        outputs = call(*args, **kwargs)
        split = runtime.holds_local_values() and any(
            entry.handler.output_axis(layer, entry.style, len(output.shape))
            is not None
            for output in keras.tree.flatten(outputs)
        )
        if split and not sums:
            raise ShardingError(
                f"Layer '{layer.path}' has an activity_regularizer "
                f"({type(layer.activity_regularizer).__name__}) and its "
                "output is split over the ranks, which would each penalise "
                "their part of it. Use keras.regularizers.L1, L2 or L1L2, "
                f"whose penalties add up, or keep '{layer.path}' whole "
                "(plan={..., path: keras_tp.Replicate()})."
            )
        returned_split[0] = split
        return outputs

    def add_whole_loss(loss):
        if returned_split[0]:
            loss = runtime.adapter.reduce_from_parallel(loss)
        return add_loss(loss)

    set_call(layer, penalised_call)
    object.__setattr__(layer, "add_loss", add_whole_loss)
