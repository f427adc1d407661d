"""Whole weights that compute on split activations: gradients summed.

A layer the plan keeps whole can still compute on one rank's part of the
activations:

- Qwen3 and Gemma 3 normalise each query and key head with one RMS
  norm's weights, called on the rank's heads;
- HGNetV2 scales and shifts split channels by one learnable scalar;
- a key/value projection with fewer heads than ranks (Gemma's single
  head) stays whole and feeds every rank's query heads.

Each rank's gradient of such weights is then a partial sum. The layer
reads its weights through `copy_to_parallel` (identity forward, all-reduce
backward), as Megatron all-reduces its sequence-parallel norms' weights,
and so are its whole inputs, sharing the copy that a region makes of the
same tensor: their gradients are summed over the ranks as well. On
global arrays (JAX without a data axis) the layer runs so on each
device's part (`runtime.run_split_function`), where XLA would otherwise
sum the gradients in collectives nobody counts. The planner's local check
finds these layers (`plan.summed_gradients`).
"""

import keras

from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import own_trainable_variables
from keras_tp.plan.trace import is_tensor
from keras_tp.regions import set_call
from keras_tp.regions import shared_value
from keras_tp.tensors import is_float


def install(plan, runtime):
    """Lets each of `plan.summed_gradients`' layers sum its gradients
    over `runtime`'s `model` axis."""
    for layer, summed in plan.summed_gradients.items():
        set_call(layer, _summed_call(layer, summed, runtime))


def _summed_call(layer, summed, runtime):
    """`layer`'s call with its weights, and its inputs that are whole
    (`summed.input_axes`: per tensor input, the axis it arrives split on),
    read through the `model` axis' `copy_to_parallel`."""
    call = layer.call
    variables = own_trainable_variables(layer)

    def entered_call(adapter, weights, args, kwargs):
        axes = iter(summed.input_axes)

        def entered(x):
            # Only tensors have an axis in `summed.input_axes`.
            if not is_tensor(x) or next(axes, None) is not None:
                return x
            if not is_float(x):
                return x
            return shared_value(x, adapter.copy_to_parallel)

        args, kwargs = keras.tree.map_structure(entered, (args, kwargs))
        pairs = [
            (v, adapter.copy_to_parallel(w)) for v, w in zip(variables, weights)
        ]
        with bind_values(pairs):
            return call(*args, **kwargs)

    def summed_call(*args, **kwargs):
        if runtime.holds_local_values():
            weights = [runtime.local_value(v) for v in variables]
            return entered_call(runtime.adapter, weights, args, kwargs)
        if not any(axis is not None for axis in summed.input_axes):
            return call(*args, **kwargs)
        leaves = keras.tree.flatten((args, kwargs))
        tensors = [leaf for leaf in leaves if is_tensor(leaf)]

        def on_each_device(adapter, *values):
            local = iter(values[: len(tensors)])
            local_leaves = [next(local) if is_tensor(x) else x for x in leaves]
            local_args, local_kwargs = keras.tree.pack_sequence_as(
                (args, kwargs), local_leaves
            )
            weights = values[len(tensors) :]
            return entered_call(adapter, weights, local_args, local_kwargs)

        return runtime.run_split_function(
            on_each_device,
            [*tensors, *(v.value for v in variables)],
            [*summed.input_axes, *(None for _ in variables)],
            output_axis=summed.output_axes[0],
        )

    return summed_call
