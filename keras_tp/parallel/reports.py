"""What the data axis keeps on each device, and whether its copies agree.

A mixin of `TensorParallelKeras`: the optimizer state and gradient bytes
per device, how a `CoordinatedOptimizer` shares the gradients, and a check
that the copies data and tensor parallelism keep are equal.
"""

from keras_tp.parallel.optimizer import CoordinatedOptimizer


class DataParallelReports:
    """The data-axis reports of `TensorParallelKeras` (see the module)."""

    def optimizer_bytes_per_device(self):
        """`{device: bytes}` of the optimizer state (slots included).

        Gradient buffers of a `CoordinatedOptimizer` are not included;
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

        Only a `CoordinatedOptimizer` keeps gradients (its buffers, which
        also accumulate micro-batches); other optimizers hold none.
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
            `optimizer_bytes`.
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
        keep of the same numbers: the parameters, and the synchronised
        gradients a `CoordinatedOptimizer` keeps. Under local SGD the
        parameters agree right after a synchronisation (at the end of
        `fit()`, say), and each replica's optimizer state is its own.

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
            # ZeRO-1 keeps each rank's own, unsynchronised gradient.
            if optimizer.zero_stage != 1:
                variables += optimizer.gradient_buffers
        differences = self._runtime.replica_differences(variables)
        worst = max(differences.values(), default=0.0)
        return {
            "consistent": worst <= atol,
            "max_difference": worst,
            "variables": differences,
        }
