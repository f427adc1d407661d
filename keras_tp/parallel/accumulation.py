"""Gradients synchronised at every update, over one or more micro-batches.

The strategy a `CoordinatedOptimizer` holds for DDP and ZeRO: the
gradients of every update are synchronised over `data` (`LocalSGD`, in
`local_sgd.py`, synchronises parameters every few updates instead). With
`gradient_accumulation_steps > 1` the micro-batches' gradients are summed
in buffers first, and the update runs once per accumulation boundary.
"""

from keras import ops

from keras_tp.errors import check_count
from keras_tp.keras_internals import average_weights
from keras_tp.keras_internals import schedule_at_micro_steps
from keras_tp.keras_internals import stateful_cond


class GradientAccumulation:
    """Synchronises the gradients of each update, after `steps` micro-batches.

    DDP and ZeRO-1 accumulate each rank's whole local gradient and
    synchronise once per update; ZeRO-2 and 3 reduce-scatter every
    micro-batch, because keeping only a partition of the gradient is their
    point.

    Args:
        steps: micro-batches per update (`gradient_accumulation_steps`).
        zero_stage: the optimizer's ZeRO stage.
        optimizer: the inner Keras optimizer, which must not accumulate
            gradients itself.
    """

    # Every replica applies the same synchronised gradients.
    replica_local = False
    optimizers = ()

    def __init__(self, steps, zero_stage, optimizer):
        check_count("gradient_accumulation_steps", steps)
        if optimizer.gradient_accumulation_steps:
            raise ValueError(
                f"Optimizer '{optimizer.name}' accumulates gradients itself; "
                "pass gradient_accumulation_steps to CoordinatedOptimizer "
                "instead, which synchronises only at accumulation boundaries."
            )
        self.steps = steps
        self.zero_stage = zero_stage
        # The sums of the micro-batches' gradients, one per variable; none
        # with one micro-batch per update.
        self.gradient_buffers = []
        self.micro_step = None

    def bind(self, placement, data_adapter, run_on_ranks):
        """Attaches the `Placement` the buffers are placed with and the
        `data` axis's adapter; `run_on_ranks` serves `LocalSGD`, not
        this."""
        self._placement = placement
        self._data_adapter = data_adapter

    def build(self, optimizer, var_list, partition_axes):
        """The buffers in which micro-batches accumulate, and their counter.

        Only gradient accumulation keeps gradients between steps: with one
        micro-batch per update, the step's gradients are applied and
        dropped, as plain Keras does. DDP and ZeRO-1 accumulate each
        rank's whole local gradient; ZeRO-2 and 3 the rank's partition of
        the reduced gradient (whole for a variable without a partition
        axis).

        Args:
            optimizer: the `CoordinatedOptimizer`, which owns the buffers.
            var_list: the trainable variables.
            partition_axes: `{id(variable): ZeRO partition axis or None}`
                (`ZeroLayout.partition_axes`).
        """
        self.gradient_buffers = []
        if self.steps == 1:
            return
        for variable in var_list:
            buffer = optimizer.add_variable_from_reference(variable, "gradient")
            axis = partition_axes[id(variable)]
            self._placement.place_like(
                buffer, variable, axis if self.zero_stage >= 2 else None
            )
            self.gradient_buffers.append(buffer)
        self.micro_step = optimizer.add_variable(
            (), initializer="zeros", dtype="int32", name="micro_step"
        )

    def apply(self, optimizer, grads, variables):
        """One micro-batch: accumulate, and update at the boundary.

        The branches are pure functions of the variables' values, so the
        collectives of the update run only on boundary steps, on every
        backend (a traced `cond` on JAX and TensorFlow).

        Args:
            optimizer: the `CoordinatedOptimizer`
                (`synchronised_gradients`, `update_parameters`).
            grads: this rank's gradients of `variables`.
            variables: the trainable variables.
        """
        if self.steps == 1:
            grads = optimizer.synchronised_gradients(grads, variables)
            optimizer.update_parameters(grads)
            return
        steps = self.steps
        partial = self.zero_stage >= 2
        if partial:
            # Keep only this rank's partition: reduce-scatter right away.
            grads = optimizer.synchronised_gradients(grads, variables)
        boundary = ops.equal(ops.mod(self.micro_step + 1, steps), 0)
        touched = list(variables) + optimizer.variables
        accumulated = [
            ops.add(buffer.value, grad)
            for buffer, grad in zip(self.gradient_buffers, grads)
        ]

        def update():
            mean = [ops.divide(g, steps) for g in accumulated]
            if not partial:
                mean = optimizer.synchronised_gradients(mean, variables)
            # The inner optimizer counts updates, Keras' micro-batches.
            with schedule_at_micro_steps(optimizer.inner_optimizer, steps):
                optimizer.update_parameters(mean)
            for buffer in self.gradient_buffers:
                buffer.assign(ops.zeros_like(buffer.value))
            self.micro_step.assign(0)

        def accumulate():
            for buffer, value in zip(self.gradient_buffers, accumulated):
                buffer.assign(value)
            self.micro_step.assign_add(1)
            inner = optimizer.inner_optimizer
            if inner.use_ema:
                # Keras averages the weights after every step; only an
                # overwrite with the averages changes the variables.
                optimizer.layout.on_partitions(
                    lambda: average_weights(inner),
                    variables,
                    self._data_adapter,
                    gathers=bool(inner.ema_overwrite_frequency),
                )

        stateful_cond(boundary, update, accumulate, touched)

    def finish(self, optimizer, variables):
        """Nothing to do: every update synchronised."""

    def synchronises(self, step):
        """Every update synchronises the data axis."""
        return True
