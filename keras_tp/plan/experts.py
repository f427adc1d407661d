"""Expert banks split over the ranks: how their outputs combine.

A layer holding a bank of experts (every weight stacked on a leading
experts axis) can give each rank its share of the experts. Whether the
ranks' outputs then gather on an axis or sum is found by running the
traced call on every rank's share (`expert_output_axis`).
"""

import logging

import numpy as np

from keras_tp.plan.comparing import as_numpy
from keras_tp.plan.comparing import close_to
from keras_tp.plan.comparing import slice_tensor
from keras_tp.plan.styles import ExpertParallel

logger = logging.getLogger(__name__)


def expert_output_axis(call, handler, tensor_parallel):
    """How the ranks' outputs of an expert split make the whole output.

    Runs the traced `call` once per rank, each on its share of the
    experts (every weight split on its leading axis).

    Args:
        call: the layer's traced `Call`.
        handler: its `OwnWeightsHandler`.
        tensor_parallel: the number of ranks.

    Returns:
        `(True, axis)` if the outputs gather on `axis`, `(True, None)` if
        they sum, `(False, None)` if neither gives the traced output.
    """
    layer = call.layer
    axes = handler.split_axes(layer, ExpertParallel())
    variables = handler.variables(layer)
    args, kwargs = call.argument_values
    try:
        outputs = []
        for rank in range(tensor_parallel):
            weights = {
                role: slice_tensor(v, tensor_parallel, axes[role], rank)
                for role, v in variables.items()
            }
            outputs.append(
                as_numpy(handler.run_local(layer, weights, args, kwargs))
            )
    except Exception:  # noqa: BLE001 - the layer cannot run on a share
        logger.debug("No expert split of '%s'", layer.path, exc_info=True)
        return False, None
    if len(call.outputs) != 1:
        return False, None
    whole = as_numpy(call.output_values[0])
    for axis in range(whole.ndim):
        if outputs[0].shape[axis] * tensor_parallel != whole.shape[axis]:
            continue
        gathered = np.concatenate(outputs, axis)
        if gathered.shape == whole.shape and close_to(gathered, whole):
            return True, axis
    if outputs[0].shape == whole.shape and close_to(sum(outputs), whole):
        return True, None
    return False, None
