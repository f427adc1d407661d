"""ZeRO-3: each layer gathers its parameter partitions around its call.

Under ZeRO-3 every rank stores a `1/data_parallel` partition of each
parameter shard (see `Placement.partition`). A layer's call gathers the
partitions it reads over the `data` axis, and the gather's backward pass
reduce-scatters the gradient, so the optimizer receives partitions. How a
backend gathers (and whether it re-gathers for the backward pass) is the
runtime's `gathered_call`.
"""

from keras_tp.keras_internals import own_trainable_variables
from keras_tp.plan.sharding_plan import walk_layers
from keras_tp.regions import set_call


def install_gathers(model, installed_regions, runtime):
    """ZeRO-3: gathers each layer's parameter partitions around its call.

    A region gathers all its members' weights at once; every other layer
    gathers the trainable variables it owns directly.

    Args:
        model: the wrapped model.
        installed_regions: the regions `install` returned.
        runtime: the runtime holding the partitions.
    """
    partitioned = runtime.placement.data_axes
    covered = set()
    for region in installed_regions:
        members = [v for v, _ in region.variables()]
        covered.update(id(v) for v in members)
        variables = [v for v in members if id(v) in partitioned]
        if variables:
            set_call(
                region.layer,
                runtime.gathered_call(
                    region.layer, variables, region.layer.call
                ),
            )
    for layer in walk_layers(model):
        variables = [
            v
            for v in own_trainable_variables(layer)
            if id(v) in partitioned and id(v) not in covered
        ]
        if variables:
            set_call(layer, runtime.gathered_call(layer, variables, layer.call))
