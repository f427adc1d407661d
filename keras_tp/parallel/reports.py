"""What the data axis keeps on each device, and whether its copies agree.

A mixin of `TensorParallelKeras`: the optimizer state and gradient bytes
each device keeps between steps, how a `CoordinatedOptimizer` shares the
gradients, and a check that the copies data and tensor parallelism keep
are equal.
"""

from keras_tp.parallel.optimizer import CoordinatedOptimizer


class DataParallelReports:
    """The data-axis reports of `TensorParallelKeras` (see the module)."""

    def optimizer_bytes_per_device(self):
        """`{device: bytes}` of the optimizer state (slots included).

        The gradient buffers a `CoordinatedOptimizer` keeps while it
        accumulates micro-batches are not included;
        `gradient_bytes_per_device()` reports them.
        """
        optimizer = self._built_optimizer()
        variables = (
            optimizer.state_variables
            if isinstance(optimizer, CoordinatedOptimizer)
            else optimizer.variables
        )
        return self._runtime.device_bytes(variables)

    def gradient_bytes_per_device(self):
        """`{device: bytes}` of the gradients each rank keeps between steps.

        Only a `CoordinatedOptimizer` with `gradient_accumulation_steps > 1`
        keeps gradients between steps: the buffers in which micro-batches
        accumulate (whole for DDP and ZeRO-1, this rank's partition for
        ZeRO-2 and 3). Otherwise every device reports 0: the gradients of
        a step live only during that step, as in plain Keras, and show in
        its peak memory, not here.

        Returns:
            `{device: bytes}`, read from the arrays.
        """
        optimizer = self._built_optimizer()
        if not isinstance(optimizer, CoordinatedOptimizer):
            return {device: 0 for device in self._runtime.devices}
        return self._runtime.device_bytes(optimizer.gradient_buffers)

    def _built_optimizer(self):
        if self.optimizer is None:
            raise ValueError("The model is not compiled: it has no optimizer.")
        if not self.optimizer.built:
            raise ValueError(
                "The optimizer has no state yet: train one step first, or "
                "call `tp.optimizer.build(tp.trainable_variables)`."
            )
        return self.optimizer

    def get_gradient_sharding_info(self):
        """How gradients and optimizer state are shared over the data axis.

        Returns:
            A dict with `zero_stage`, `data_parallel`, `bucket_cap_mb`,
            `gradient_accumulation_steps`, `local_sgd_steps`,
            `outer_optimizer`, `buckets` (per bucket: index,
            MB, number of variables and its collective),
            `unpartitioned_variables`, and per device, measured from the
            arrays, `parameter_bytes`, `gradient_bytes` and
            `optimizer_bytes`: what the device keeps between steps. The
            gradient bytes are those of the accumulation buffers, 0
            without gradient accumulation.
        """
        optimizer = self._built_optimizer()
        if not isinstance(optimizer, CoordinatedOptimizer):
            raise ValueError(
                "The model trains with plain tensor parallelism (no data "
                "axis, no ZeRO): its gradients are not shared. Pass "
                "data_parallel or zero_stage to TensorParallelKeras."
            )
        info = optimizer.sharding_info()
        info["parameter_bytes"] = self.parameter_bytes_per_device()
        info["gradient_bytes"] = self.gradient_bytes_per_device()
        info["optimizer_bytes"] = self.optimizer_bytes_per_device()
        return info

    def check_gradient_consistency(self, atol=0.0):
        """Debug check that the replicas of every variable agree.

        Compares the copies that data parallelism and tensor parallelism
        keep of the same numbers: the parameters (and other model
        variables), the optimizer state of a `CoordinatedOptimizer`, and,
        when it accumulates micro-batches under ZeRO-2 or 3, the reduced
        gradient partitions it sums. DDP and ZeRO-1 accumulate each rank's
        own local gradient, whose copies differ until the update. Under
        local SGD the parameters agree right after a synchronisation (at
        the end of `fit()`, say), and each replica's optimizer state is
        its own.

        Args:
            atol: largest difference tolerated.

        Returns:
            `{"consistent": bool, "max_difference": float, "variables":
            {path: difference}}`.
        """
        variables = list(self.model.variables)
        # Before compile() a Keras model may not have the attribute yet.
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, CoordinatedOptimizer) and optimizer.built:
            own = {id(v) for v in optimizer.replica_state_variables}
            variables += [
                v for v in optimizer.state_variables if id(v) not in own
            ]
            # DDP and ZeRO-1 accumulate each rank's own, unsynchronised
            # gradient; the buffers exist only with accumulation.
            if optimizer.zero_stage >= 2:
                variables += optimizer.gradient_buffers
        differences = self._runtime.replica_differences(variables)
        worst = max(differences.values(), default=0.0)
        return {
            "consistent": worst <= atol,
            "max_difference": worst,
            "variables": differences,
        }
