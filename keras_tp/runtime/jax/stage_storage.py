"""Where a JAX pipeline's variables live: each stage's `JaxRuntime` places
those its stage owns (ZeRO-1 partitions the slots over its replicas); a
later stage that uses a weight receives a copy each step."""

from keras_tp.runtime.jax.devices import to_jax_device


class StageStorage:
    """Pipeline runtime mixin: the storage the module docstring tells."""

    def _owner_runtime(self, variable):
        """The runtime of the stage storing `variable` (the first for the
        optimizer's own variables)."""
        return self.stage_runtimes[self.stage_of.get(id(variable), 0)]

    def local_pieces(self, variable):
        return self._owner_runtime(variable).local_pieces(variable)

    def assign_local_pieces(self, variable, read):
        # Other stages that use it read a copy of the owner's each step.
        self._owner_runtime(variable).assign_local_pieces(variable, read)

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
