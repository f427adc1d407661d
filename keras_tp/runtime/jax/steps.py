"""Steps and direct calls on the mesh.

Without a data axis Keras' own compiled step runs unchanged (its regions
are `shard_map`s). With a data axis or ZeRO the whole step runs inside one
`shard_map` over both axes, each device on its own values. A direct call
`tp(x)` on arrays is compiled once, as Keras compiles `predict`.

A per-replica variable (local SGD) enters a per-rank step as each data
rank's own block, and a direct call as replica 0's.
"""

import functools

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.errors import ShardingError
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import in_symbolic_scope
from keras_tp.keras_internals import jax_update_metrics
from keras_tp.keras_internals import local_shapes
from keras_tp.plan.split_logits import whole_logits
from keras_tp.runtime import padding
from keras_tp.runtime.jax.regions import is_array


def is_concrete(value):
    """An array with values now, not a tracer or a symbolic tensor."""
    return isinstance(value, (jax.Array, np.ndarray)) and not isinstance(
        value, jax.core.Tracer
    )


class MeshSteps:
    """The `JaxRuntime`'s steps and direct calls (see the module)."""

    def run_step(self, phase, step, *args, **kwargs):
        if not self.per_rank_steps:
            return super().run_step(phase, step, *args, **kwargs)
        state, data = args
        model = step.__self__
        extra = padding.rows_to_add(data, self.data_parallel)
        with self.adapter.stats.recording(phase):
            if extra and phase != "train":
                with whole_logits():
                    return self._padded_step(phase, model, state, data, extra)
            return self._per_rank_step(phase, model, step, state, data)

    def _padded_step(self, phase, model, state, data, extra):
        """A predict or test step on a batch that needed `extra` rows to
        split over `data` (see `keras_tp.runtime.padding`).

        Every device predicts its slice of the padded batch; the padded
        rows are dropped from the outputs, and a test step computes the
        loss and the metrics on the real rows of the global batch.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        size = padding.batch_size(x)
        predict = keras.Model.predict_step.__get__(model)
        trainable, non_trainable = state[0], state[1]
        outputs, non_trainable = self._per_rank_step(
            "predict",
            model,
            predict,
            (trainable, non_trainable),
            (padding.padded(x, extra),),
        )
        y_pred = padding.dropped(outputs, size)
        if phase == "predict":
            return y_pred, non_trainable
        loss, (trainable, non_trainable, metrics) = (
            model.stateless_compute_loss(
                trainable,
                non_trainable,
                state[2],
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=False,
            )
        )
        logs, metrics = jax_update_metrics(
            model, metrics, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, metrics)

    def _per_rank_step(self, phase, model, step, state, data):
        """Runs Keras' step on every device, on that device's values.

        The state enters with the placement of each variable, the batch
        split over `data`; the metrics' updates are summed over `data` and
        the non-trainable variables (BatchNorm statistics) averaged, in one
        all-reduce, so the logs are those of the global batch. A
        per-replica variable enters as each data rank's own block.
        """
        groups = [model.trainable_variables, model.non_trainable_variables]
        if phase == "train":
            groups.append(model.optimizer.variables)
        if phase != "predict":
            groups.append(model.metrics_variables)
        state_specs = tuple(
            [self.variable_spec(v) for v in group] for group in groups
        )
        per_replica = [
            [self.placement.is_per_replica(v) for v in group]
            for group in groups
        ]
        data_specs = jax.tree_util.tree_map(self._batch_spec, data)
        placed = [
            v for group in groups for v in group if self.placement.is_placed(v)
        ]
        # In a job of several processes, outputs split over `data` span
        # devices no one process can read (Keras reads `predict()`'s as
        # NumPy): every device gathers the whole batch's outputs.
        gathered = phase == "predict" and jax.process_count() > 1

        def per_rank(state, data):
            state = tuple(map(_own_blocks, state, per_replica))
            with (
                local_shapes(placed, self.placement.local_shape),
                self.tracing_per_rank(),
            ):
                if phase == "predict":
                    outputs, non_trainable = step(state, data)
                    if gathered:
                        outputs = jax.tree.map(
                            lambda y: self.data_adapter.all_gather(y, 0),
                            outputs,
                        )
                    return outputs, _as_blocks(non_trainable, per_replica[1])
                logs, new_state = step(state, data)
                new_state = list(new_state)
                metrics, non_trainable = self.synchronised_state(
                    groups[1], new_state[1], state[-1], new_state[-1]
                )
                new_state[1], new_state[-1] = non_trainable, metrics
                mapping = list(zip(groups[-1], metrics))
                with StatelessScope(state_mapping=mapping):
                    logs = model.get_metrics_result()
                return logs, tuple(map(_as_blocks, new_state, per_replica))

        # Keras' predict step returns the outputs, split over `data`, and
        # the non-trainable state (dropout seeds), placed as it entered.
        out_specs = (
            (PartitionSpec(*([] if gathered else ["data"])), state_specs[1])
            if phase == "predict"
            else (PartitionSpec(), state_specs)
        )
        mapped = jax.shard_map(
            per_rank,
            mesh=self.mesh,
            in_specs=(state_specs, data_specs),
            out_specs=out_specs,
            check_vma=False,
        )
        return mapped(tuple(state), data)

    def data_row(self):
        """The rows of the mesh this process's devices hold, as one share
        of each batch, where every process holds as many rows, in one run
        (a process may hold part of a row, as its tensor-parallel ranks
        span processes); else `None`: every process reads whole batches."""
        if jax.process_count() == 1 or self.data_parallel == 1:
            return None
        held = [set() for _ in range(jax.process_count())]
        for row, devices in enumerate(self.mesh.devices):
            for device in devices:
                held[device.process_index].add(row)
        count = len(held[0])
        for rows in held:
            first = min(rows, default=0)
            if not count or rows != set(range(first, first + count)):
                return None
            if first % count:
                return None
        first = min(held[jax.process_index()])
        return first // count, self.data_parallel // count

    def step_function(self, function):
        place = self.data_row()
        if place is None or getattr(function, "takes_shares", False):
            return function
        sharding = NamedSharding(self.mesh, PartitionSpec("data"))

        def global_array(share):
            if np.ndim(share) == 0:
                return share
            shape = (share.shape[0] * place[1],) + share.shape[1:]
            return jax.make_array_from_process_local_data(
                sharding, share, shape
            )

        @functools.wraps(function)
        def step(state, iterator):
            # Keras' JAX steps take an iterator of batches.
            if self.batches_are_shares:
                iterator = (jax.tree.map(global_array, b) for b in iterator)
            return function(state, iterator)

        step.takes_shares = True
        return step

    def run_on_ranks(self, fn, variables, phase):
        """Runs `fn()` on every device in a compiled `shard_map`, as a
        per-rank step runs, and writes back what it assigned."""
        specs = [self.variable_spec(v) for v in variables]
        per_replica = [self.placement.is_per_replica(v) for v in variables]
        placed = [v for v in variables if self.placement.is_placed(v)]

        def per_rank(values):
            mapping = list(zip(variables, _own_blocks(values, per_replica)))
            with (
                local_shapes(placed, self.placement.local_shape),
                self.tracing_per_rank(),
                StatelessScope(state_mapping=mapping) as scope,
            ):
                fn()
                new = [scope.get_current_value(v) for v in variables]
            return _as_blocks(new, per_replica)

        mapped = jax.jit(
            jax.shard_map(
                per_rank,
                mesh=self.mesh,
                in_specs=(specs,),
                out_specs=specs,
                check_vma=False,
            )
        )
        # Traced at every call, so that its collectives are recorded.
        with self.adapter.stats.recording(phase):
            new = mapped([v.value for v in variables])
        for variable, value in zip(variables, new):
            variable.assign(value)

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` on concrete arrays runs compiled.

        Run eagerly, each region's `shard_map` would be traced and compiled
        again at every call (seconds per call for a keras-hub model); the
        whole call is compiled once instead, as Keras compiles `predict`.
        Inside a trace (a step, a user's `jax.jit`) the call is traced as
        part of it.
        """
        if self._inside_ranks:
            return super().call_model(model, inputs, training)
        leaves = jax.tree_util.tree_leaves(inputs)
        stacked = [
            v for v in model.variables if self.placement.is_per_replica(v)
        ]
        if not all(map(is_concrete, leaves)):
            if self.placement.blocks and not in_symbolic_scope():
                raise ShardingError(
                    "A model with Columns split by blocks "
                    "(Column(blocks=b)) was called inside a trace of your "
                    "own (jax.jit, jax.grad), where the code between its "
                    "split layers would run on global arrays, which hold "
                    "those Columns' outputs in their stored order. Call it "
                    "on concrete arrays, or through fit(), predict() or "
                    "evaluate(), which run per rank."
                )
            # Per-replica variables read replica 0's block.
            with bind_values(
                [(v, self.first_replica_value(v)) for v in stacked]
            ):
                return super().call_model(model, inputs, training)
        if self.placement.blocks:
            return self._call_per_rank(model, inputs, training)
        compiled = self._compiled_calls.get(training)
        if compiled is None:
            compiled = jax.jit(
                functools.partial(self._stateless_call, model, training)
            )
            self._compiled_calls[training] = compiled
        values = [self.first_replica_value(v) for v in model.variables]
        with local_shapes(stacked, self.full_shape):
            outputs, non_trainable = compiled(values, inputs)
        # A forward pass updates only non-trainable state (BatchNorm
        # statistics, dropout seeds).
        for variable, value in zip(
            model.non_trainable_variables, non_trainable
        ):
            variable.assign(value)
        return outputs

    def _call_per_rank(self, model, inputs, training):
        """A direct call of a model with Columns split by blocks, run per
        rank as its steps are: on global arrays the code between regions
        would read a blocked Column's output in its stored layout."""
        key = ("per rank", training)
        compiled = self._compiled_calls.get(key)
        if compiled is None:

            def call(state, data):
                return model.stateless_call(*state, *data, training=training)

            compiled = jax.jit(
                lambda state, data: self._per_rank_step(
                    "predict", model, call, state, data
                )
            )
            self._compiled_calls[key] = compiled
        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
        )
        with self.adapter.stats.recording("predict"):
            outputs, non_trainable = compiled(state, (inputs,))
        for variable, value in zip(
            model.non_trainable_variables, non_trainable
        ):
            variable.assign(value)
        return outputs

    def _stateless_call(self, model, training, values, inputs):
        with StatelessScope(
            state_mapping=list(zip(model.variables, values))
        ) as scope:
            outputs = super().call_model(model, inputs, training)
        non_trainable = [
            scope.get_current_value(v) for v in model.non_trainable_variables
        ]
        return outputs, non_trainable

    def _batch_spec(self, leaf):
        if not is_array(leaf) or len(leaf.shape) == 0:
            return PartitionSpec()
        self.check_batch_size(leaf.shape[0])
        return PartitionSpec("data")


def _own_blocks(values, per_replica):
    """Each device's values, its own block for per-replica variables.

    Inside a per-rank step a per-replica value enters as the device's
    block of the stack, `(1, *local shape)`.
    """
    return [v[0] if stacked else v for v, stacked in zip(values, per_replica)]


def _as_blocks(values, per_replica):
    """Inverse of `_own_blocks`: per-replica values as blocks again."""
    return [
        v[None] if stacked else v for v, stacked in zip(values, per_replica)
    ]
