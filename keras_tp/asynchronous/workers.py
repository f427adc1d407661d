"""A worker's step, written once for every backend: the loss of a slice.

The backends differentiate `stateless_loss` with their own autodiff
(`keras_tp.runtime.<backend>.asynchronous`); everything else a worker does
is here.
"""

import keras

from keras_tp.keras_internals import compute_loss
from keras_tp.keras_internals import seed_generators
from keras_tp.rank_draws import RANK_SEED_STRIDE


def stateless_loss(
    model, trainable_values, non_trainable_values, x, y, sample_weight
):
    """The training loss of `model` on one slice, with the given values.

    Args:
        model: the compiled model.
        trainable_values: values of `model.trainable_variables`.
        non_trainable_values: values of `model.non_trainable_variables`.
        x, y, sample_weight: the slice.

    Returns:
        `(loss, new non-trainable values)`: the scalar loss (with the
        model's `add_loss` terms) and the non-trainable values after the
        call (moving statistics, seed states).
    """
    trainable = model.trainable_variables
    non_trainable = model.non_trainable_variables
    mapping = list(zip(trainable, trainable_values)) + list(
        zip(non_trainable, non_trainable_values)
    )
    data = {"x": x, "y": y, "sample_weight": sample_weight}
    with keras.StatelessScope(state_mapping=mapping) as scope:
        y_pred = model(x, training=True)
        loss = compute_loss(model, y_pred=y_pred, training=True, **data)
    updated = []
    for variable, value in zip(non_trainable, non_trainable_values):
        new = scope.get_current_value(variable)
        updated.append(value if new is None else new)
    return loss, updated


def worker_non_trainable_values(model, worker):
    """The non-trainable values worker `worker` starts from, as NumPy.

    Each worker draws dropout masks from its own random stream: its seed
    states are shifted by its index.
    """
    seeds = {id(g.state) for g in seed_generators(model)}
    values = []
    for variable in model.non_trainable_variables:
        value = keras.ops.convert_to_numpy(variable.value)
        if id(variable) in seeds:
            value = value.copy()
            # Each worker's seed moves by its own stride: the workers'
            # dropout masks differ.
            value[0] = value[0] + worker * RANK_SEED_STRIDE
        values.append(value)
    return values


def combined_non_trainable_values(model, per_worker):
    """What the model keeps of the workers' non-trainable values.

    Floating-point state (moving statistics) is averaged over the workers;
    other state (seed states, counters) is worker 0's, which unshifted is
    the model's own stream.

    Args:
        model: the model.
        per_worker: a list, per worker, of NumPy values of
            `model.non_trainable_variables`.
    """
    combined = []
    for i, variable in enumerate(model.non_trainable_variables):
        values = [worker[i] for worker in per_worker]
        if keras.backend.is_float_dtype(variable.dtype):
            combined.append(sum(values) / len(values))
        else:
            combined.append(values[0])
    return combined
