"""Where a JAX pipeline's variables live: each stage's `JaxRuntime` places
those its stage owns (ZeRO-1 partitions the slots over its replicas); a
later stage that uses a weight receives a copy each step."""

from keras_tp.runtime.jax.devices import to_jax_device


class StageStorage:
    """Pipeline runtime mixin: the storage the module docstring tells."""

    def local_pieces(self, variable):
        # The optimizer's own variables, unplaced, with the first stage's.
        runtime = self.stage_runtime_of(variable) or self.stage_runtimes[0]
        return runtime.local_pieces(variable)

    def assign_local_pieces(self, variable, read):
        # Other stages that use it read a copy of the owner's each step.
        runtime = self.stage_runtime_of(variable) or self.stage_runtimes[0]
        runtime.assign_local_pieces(variable, read)

    def place_variable_like(self, variable, reference, data_axis):
        """Places an optimizer slot on its reference's stage."""
        stage = self.owners.adopt(variable, reference)
        placement = self.stage_runtimes[stage].placement
        axis = placement.partition_axis(reference) if self.zero_stage else None
        placement.place_like(variable, reference, axis)

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables, by the stage runtimes."""
        totals = {}
        for runtime in self.stage_runtimes:
            totals.update(runtime.device_bytes(variables))
        return {name: totals[str(to_jax_device(name))] for name in self.devices}
