"""Whole weights that compute on split activations: gradients summed.

Where ranks hold their own slices (torch, TensorFlow, JAX with a data
axis), a layer the plan keeps whole can still compute on one rank's part
of the heads:

- Qwen3 and Gemma 3 normalise each query and key head with one RMS
  norm's weights, called on the rank's heads;
- a key/value projection with fewer heads than ranks (Gemma's single
  head) stays whole and feeds every rank's query heads.

Each rank's gradient of such weights is then a partial sum. The layer
reads its weights through `copy_to_parallel` (identity forward, all-reduce
backward), as Megatron all-reduces its sequence-parallel norms' weights,
and so are its whole inputs, sharing the copy that a region makes of the
same tensor: their gradients are summed over the ranks as well. The
planner's local check finds these layers (`plan.summed_gradients`).
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
    where `runtime`'s ranks hold their own slices."""
    for layer, split_inputs in plan.summed_gradients.items():
        set_call(layer, _summed_call(layer, split_inputs, runtime))


def _summed_call(layer, split_inputs, runtime):
    """`layer`'s call with its weights, and its inputs that are whole
    (`split_inputs`: per tensor input, whether it arrives split), read
    through the `model` axis' `copy_to_parallel`."""
    call = layer.call
    variables = own_trainable_variables(layer)

    def summed_call(*args, **kwargs):
        if not runtime.holds_local_values():
            return call(*args, **kwargs)
        enter = runtime.adapter.copy_to_parallel
        flags = iter(split_inputs)

        def entered(x):
            if not is_tensor(x) or next(flags, False) or not is_float(x):
                return x
            return shared_value(x, enter)

        args, kwargs = keras.tree.map_structure(entered, (args, kwargs))
        pairs = [(v, enter(runtime.local_value(v))) for v in variables]
        with bind_values(pairs):
            return call(*args, **kwargs)

    return summed_call
