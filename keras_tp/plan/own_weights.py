"""Layers that compute with weights of their own: `Channelwise` and experts.

BatchNormalization, a depthwise convolution, an expert bank written with
raw `einsum`s: keras_tp cannot see their math, so their own `call` runs on
each rank's slices of their weights, and the planner checks a split on
the traced values before it chooses one.
"""

import numpy as np

from keras_tp.errors import ShardingError
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import own_trainable_variables
from keras_tp.keras_internals import own_variables
from keras_tp.keras_internals import sublayers
from keras_tp.plan.handler import LayerHandler
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import ExpertParallel


class _LocalValues(StatelessScope):
    """Inside, the given variables read as this rank's values."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def get_current_value(self, variable):
        return self.values.get(id(variable))


class OwnWeightsHandler(LayerHandler):
    """A layer computing with weights of its own, in code keras_tp can't see.

    An expert bank written with raw `einsum`s, a BatchNormalization, a
    depthwise convolution: the layer's own `call` runs on each rank's
    slices of its weights, unchanged.

    - `Channelwise()` splits every weight on its channel axis: the one
      axis whose length all of the layer's weights share. The layer needs
      no region and no collective: its input arrives split (a `Column`
      output) and so does its output.
    - `ExpertParallel()` splits every weight on its leading (experts)
      axis; each rank's outputs are gathered or summed.

    Whether a split is exact depends on code keras_tp cannot see, so
    `auto_plan` only chooses these styles after checking them on the
    traced values.
    """

    styles = (Channelwise, ExpertParallel)

    def matches(self, layer):
        if not own_trainable_variables(layer):
            return False
        return not any(sub.weights for sub in sublayers(layer))

    def variables(self, layer):
        roles = {}
        for variable in own_variables(layer):
            role = variable.name
            while role in roles:
                role += "_"
            roles[role] = variable
        return roles

    def primary_role(self, layer):
        roles = self.variables(layer)
        return max(roles, key=lambda role: np.prod(roles[role].shape))

    def needs_region(self, style):
        return not isinstance(style, Channelwise)

    def split_axes(self, layer, style):
        variables = self.variables(layer)
        shapes = [tuple(v.shape) for v in variables.values()]
        if isinstance(style, ExpertParallel):
            if self.expert_count(layer) is None:
                raise ShardingError(
                    f"Layer '{layer.path}': ExpertParallel() splits every "
                    "weight on its leading (experts) axis, but the weights "
                    f"have shapes {shapes}. Map it to Replicate()."
                )
            return {role: 0 for role in variables}
        length = self.channel_length(layer)
        if length is None:
            raise ShardingError(
                f"Layer '{layer.path}': Channelwise() splits every weight on "
                "its channel axis, the one axis length all its weights share,"
                f" but the weight shapes {shapes} have no such length. Map it "
                "to Replicate()."
            )
        return {
            role: tuple(v.shape).index(length) for role, v in variables.items()
        }

    def expert_count(self, layer):
        """The leading length all the layer's weights share, or `None`."""
        leading = {tuple(v.shape)[:1] for v in own_variables(layer)}
        if len(leading) != 1 or leading == {()}:
            return None
        return leading.pop()[0]

    def channel_length(self, layer):
        """The length every weight has on exactly one axis, or `None`.

        An axis of length 1 holds no channels to split: a bias-free
        depthwise kernel, `(k, k, channels, 1)`, has its channels' length.
        """
        shapes = [tuple(v.shape) for v in own_variables(layer)]
        lengths = {
            length
            for length in shapes[0]
            if length > 1 and all(shape.count(length) == 1 for shape in shapes)
        }
        return lengths.pop() if len(lengths) == 1 else None

    def parallel_input(self, style):
        return isinstance(style, ExpertParallel)

    def call_on_local_values(self, layer, runtime):
        """The call a `Channelwise` layer runs on split values, or `None`
        for its own `call`, which reads the rank's values of its weights
        (`runtime.local_value`)."""
        return None

    def run_local(self, layer, weights, args, kwargs):
        """Runs the layer's own `call` with its weights read as `weights`."""
        variables = self.variables(layer)
        local = {id(variables[role]): value for role, value in weights.items()}
        with _LocalValues(local):
            return type(layer).call(layer, *args, **kwargs)

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        outputs = self.run_local(layer, weights, (inputs,), kwargs)
        if style.output_axis is None:
            return adapter.reduce_from_parallel(outputs)
        return adapter.gather_from_parallel(outputs, style.output_axis)
