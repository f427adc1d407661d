"""`CoordinatedOptimizer`: data parallelism and ZeRO around any Keras optimizer.

The optimizer runs on every rank, on that rank's tensors. Gradients of
tensor-parallel shards are already exact on their rank; what is left is the
`data` axis of the mesh, where each rank saw another slice of the batch:

- stage 0 (DDP): the gradients are averaged with one all-reduce per bucket;
- stage 1: each rank keeps the full local gradient, reduce-scatters it, and
  updates only its partition of the optimizer state; the updated parameter
  partitions are all-gathered;
- stage 2: as stage 1, but only the gradient partition is kept;
- stage 3: parameters are partitioned too; the runtime gathers a layer's
  parameters around its call, and the gather's backward pass reduce-scatters
  the gradient, so the optimizer receives partitions.

A variable is partitioned along the first axis of its tensor-parallel shard
that the data-parallel size divides; a variable with no such axis stays
whole on every rank and its gradient is all-reduced.

Stages 0 to 2 can compress what they send (`compression.py`).
"""

import logging

import keras
from keras import ops

from keras_tp.collectives.hierarchy import HierarchicalAdapter
from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import model_variables_of
from keras_tp.keras_internals import moving_average
from keras_tp.keras_internals import own_optimizer_variables
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.keras_internals import stateful_cond
from keras_tp.parallel import bucket_probe
from keras_tp.parallel.bucket_probe import probe_link
from keras_tp.parallel.buckets import make_buckets
from keras_tp.parallel.buckets import partition
from keras_tp.parallel.clipping import clipped
from keras_tp.parallel.compression import Compression
from keras_tp.parallel.compression import make_codec

logger = logging.getLogger(__name__)


class CoordinatedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer for data parallelism and ZeRO stages 0 to 3.

    `TensorParallelKeras.compile()` wraps the given optimizer in one of these
    when the model has a data axis or a ZeRO stage; build one yourself to
    choose the bucket size or gradient accumulation. Every Keras optimizer
    works inside, with learning-rate schedules, weight decay, `clipvalue`,
    `clipnorm`, `global_clipnorm` and EMA: norms are computed over the whole
    model across shards (one all-reduce of the squared norms), and the
    step counter and schedule are the same on every rank.

    Args:
        optimizer: the Keras optimizer that updates the parameters.
        zero_stage: 0 (DDP), 1, 2 or 3; must match the model's.
        bucket_cap_mb: most megabytes of gradient per collective call, or
            `"auto"`: the size whose call latency is a tenth of its time,
            from all-reduces timed over the data axis when the model
            compiles (`keras_tp.parallel.bucket_probe`; the measurement
            is `link_probe`).
        gradient_accumulation_steps: micro-batches per update. DDP and
            ZeRO-1 accumulate the local gradient and synchronise once per
            update; ZeRO-2 and 3 reduce-scatter every micro-batch, because
            keeping only a partition of the gradient is their point.
        compression: how gradients travel over the data axis: `None`
            (as they are), `"bf16"`, `"fp16"`, `"powersgd"`, `"sign"` or
            a `keras_tp.Compression`. Stages 0 to 2 only.
        overlap: whether DDP (stage 0, uncompressed, one micro-batch per
            update) starts each bucket's all-reduce during the backward
            pass, as soon as the bucket's gradients are ready, where the
            runtime can (torch). On JAX and TensorFlow the compiler
            schedules the step's collectives itself.
        hierarchical: whether gradients are reduced within each host
            first, then across hosts, then shared within the host again,
            so only `1 / ranks_per_host` of them crosses between hosts
            (`keras_tp.collectives.hierarchy`). It applies where the data
            axis spans several hosts, each with the same number of
            consecutive ranks (torch under torchrun, JAX under
            `jax.distributed`); elsewhere it is a plain reduction. ZeRO-3's
            parameter gathers stay flat.
        name: name of the optimizer.

    Example:

    ```python
    tp = keras_tp.TensorParallelKeras(model, world_size=4, data_parallel=4,
                                      zero_stage=1)
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.AdamW(1e-3, global_clipnorm=1.0),
        zero_stage=1, bucket_cap_mb=25, gradient_accumulation_steps=2,
        compression="bf16")
    tp.compile(optimizer=optimizer, loss="mse")
    ```
    """

    def __init__(
        self,
        optimizer,
        zero_stage=0,
        bucket_cap_mb=25,
        gradient_accumulation_steps=1,
        compression=None,
        overlap=True,
        hierarchical=False,
        name=None,
    ):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "CoordinatedOptimizer wraps a keras.optimizers.Optimizer, got "
                f"{type(optimizer)}."
            )
        if isinstance(optimizer, CoordinatedOptimizer):
            raise ValueError("The optimizer is already a CoordinatedOptimizer.")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise NotImplementedError(
                "LossScaleOptimizer inside CoordinatedOptimizer is not "
                "supported yet; train in float32 or bfloat16."
            )
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}."
            )
        if bucket_cap_mb != "auto" and not (
            isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0
        ):
            raise ValueError(
                f"bucket_cap_mb must be a number > 0 or 'auto', got "
                f"{bucket_cap_mb!r}."
            )
        if (
            not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1
        ):
            raise ValueError(
                "gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        if optimizer.gradient_accumulation_steps:
            raise ValueError(
                f"Optimizer '{optimizer.name}' accumulates gradients itself; "
                "pass gradient_accumulation_steps to CoordinatedOptimizer "
                "instead, which synchronises only at accumulation boundaries."
            )
        if optimizer.built:
            raise ValueError(
                f"Optimizer '{optimizer.name}' is already built on other "
                "variables; give CoordinatedOptimizer a new optimizer."
            )
        compression = Compression.get(compression)
        if compression is not None and zero_stage == 3:
            raise ValueError(
                f"compression={compression.kind!r} does not apply to "
                "zero_stage=3, whose gradients are reduce-scattered by the "
                "backward pass of its parameter gathers. Use zero_stage=2 "
                "to compress gradients, or compression=None with "
                "zero_stage=3."
            )
        super().__init__(
            learning_rate=0.0, name=name or f"coordinated_{optimizer.name}"
        )
        self.inner_optimizer = optimizer
        self.zero_stage = zero_stage
        self.bucket_cap_mb = bucket_cap_mb
        # Not `gradient_accumulation_steps`: Keras' base optimizer would
        # build its own accumulators from that attribute.
        self.accumulation_steps = gradient_accumulation_steps
        self.compression = compression
        self.overlap = overlap
        self.hierarchical = hierarchical
        # The runtime's `BackwardOverlap`, once it has attached one.
        self.backward_overlap = None
        # Norms need every shard's gradient, so clipping by norm happens
        # here, across ranks, instead of in the inner optimizer.
        self.clip_norm = optimizer.clipnorm
        self.global_clip_norm = optimizer.global_clipnorm
        optimizer.clipnorm = None
        optimizer.global_clipnorm = None
        # What `bucket_cap_mb="auto"` measured, once bound to a mesh.
        self.link_probe = None
        self._placement = None
        self._codec = None
        self._data_adapter = None
        self._world_adapter = None

    def bind(
        self, placement, data_adapter, world_adapter, time_all_reduce=None
    ):
        """Attaches the mesh whose ranks this optimizer coordinates.

        Args:
            placement: the `Placement` of the model's variables; slots and
                gradient buffers are placed like their variables.
            data_adapter: the collective adapter of the `data` axis (a
                `HierarchicalAdapter` for `hierarchical=True`).
            world_adapter: the adapter over the whole mesh.
            time_all_reduce: the runtime's timer of an all-reduce over
                `data` (see `bucket_probe.probe_link`), for
                `bucket_cap_mb="auto"`.
        """
        if self._placement is not None and self._placement is not placement:
            raise ValueError(
                f"CoordinatedOptimizer '{self.name}' already belongs to "
                "another TensorParallelKeras model; compile with a new one."
            )
        self._placement = placement
        self._data_adapter = data_adapter
        self._world_adapter = world_adapter
        if (
            self.bucket_cap_mb == "auto"
            and self.link_probe is None
            and placement.data_parallel > 1
        ):
            self.link_probe = probe_link(time_all_reduce)
            logger.info("bucket_cap_mb='auto': %s", self.link_probe.describe())

    # Building -----------------------------------------------------------

    @property
    def _cap_bytes(self):
        return self._cap_mb * 2**20

    @property
    def _cap_mb(self):
        if self.bucket_cap_mb != "auto":
            return self.bucket_cap_mb
        # Without a data axis nothing is sent: any size does.
        if self.link_probe is None:
            return bucket_probe.LARGEST_MB
        return self.link_probe.bucket_cap_mb

    @property
    def data_parallel(self):
        return self._placement.data_parallel

    def build(self, var_list):
        if self._placement is None:
            raise ValueError(
                "CoordinatedOptimizer only runs inside a TensorParallelKeras "
                "model: pass it to `TensorParallelKeras.compile()`."
            )
        placement = self._placement
        var_list = list(var_list)
        self.partition_axes = {
            id(v): (placement.partition_axis(v) if self.zero_stage else None)
            for v in var_list
        }
        self.buckets = make_buckets(
            var_list,
            self.partition_axes,
            placement.model_shard_shape,
            self._cap_bytes,
        )

        def placed(slot, reference_variable):
            placement.place_like(
                slot,
                reference_variable,
                self._slot_partition_axis(reference_variable),
            )

        place_slots_on_creation(self.inner_optimizer, placed)
        self.inner_optimizer.build(var_list)
        self.gradient_buffers = []
        for variable in var_list:
            buffer = self.add_variable_from_reference(variable, "gradient")
            axis = self.partition_axes[id(variable)]
            keep_partition = self.zero_stage >= 2 and axis is not None
            placement.place_like(
                buffer, variable, axis if keep_partition else None
            )
            self.gradient_buffers.append(buffer)
        if self.accumulation_steps > 1:
            self.micro_step = self.add_variable(
                (), initializer="zeros", dtype="int32", name="micro_step"
            )
        # Errors and PowerSGD's `Q`s are optimizer variables, so that
        # checkpoints keep them.
        self._codec = (
            None
            if self.compression is None
            else make_codec(self.compression, self, var_list)
        )
        super().build(var_list)

    def _slot_partition_axis(self, reference_variable):
        if self.zero_stage == 0:
            return None
        return self.partition_axes.get(id(reference_variable))

    @property
    def variables(self):
        return own_optimizer_variables(self) + self.inner_optimizer.variables

    @property
    def state_variables(self):
        """Variables of the optimizer state: all but the gradient buffers.

        They include the compression's errors and `Q`s.
        """
        buffers = {id(b) for b in self.gradient_buffers}
        return [v for v in self.variables if id(v) not in buffers]

    @property
    def compression_variables(self):
        """The state the compression keeps: errors and PowerSGD's `Q`s.

        Each rank's error is its own (a row per data rank); a `Q` is the
        same on every data rank. Empty without compression or for the
        16-bit casts, which keep none.
        """
        return [] if self._codec is None else list(self._codec.variables)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    # Applying -----------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """Synchronises `grads` over the data axis and updates the model.

        Called on every rank with that rank's gradients of its local
        tensors (for ZeRO-3, of its parameter partitions).
        """
        if trainable_variables is None:
            trainable_variables = model_variables_of(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = [
            ops.zeros(tuple(v.shape), v.dtype) if g is None else g
            for g, v in zip(grads, trainable_variables)
        ]
        steps = self.accumulation_steps
        with self._data_adapter.stats.labelled("optimizer"):
            if steps == 1:
                self._update(self._synchronised(grads, trainable_variables))
                return
            self._accumulate_or_update(grads, trainable_variables)

    def _accumulate_or_update(self, grads, variables):
        """One micro-batch: accumulate, and update at the boundary.

        The branches are pure functions of the variables' values, so the
        collectives of the update run only on boundary steps, on every
        backend (a traced `cond` on JAX and TensorFlow).
        """
        steps = self.accumulation_steps
        stage = self.zero_stage
        if stage >= 2:
            # Keep only this rank's partition: reduce-scatter right away.
            grads = self._reduce_scatter(grads, variables)
        boundary = ops.equal(ops.mod(self.micro_step + 1, steps), 0)
        touched = list(variables) + self.variables
        accumulated = [
            ops.add(buffer.value, grad)
            for buffer, grad in zip(self.gradient_buffers, grads)
        ]

        def update():
            mean = [ops.divide(g, steps) for g in accumulated]
            if stage < 2:
                mean = self._synchronised(mean, variables)
            self._update(mean)
            for buffer in self.gradient_buffers:
                buffer.assign(ops.zeros_like(buffer.value))
            self.micro_step.assign(0)

        def accumulate():
            for buffer, value in zip(self.gradient_buffers, accumulated):
                buffer.assign(value)
            self.micro_step.assign_add(1)

        stateful_cond(boundary, update, accumulate, touched)

    def _synchronised(self, grads, variables):
        """The gradients every rank uses, each of its own partition."""
        if self.zero_stage == 0:
            grads = self._all_reduce(grads, variables)
            self._store_gradients(grads)
            return grads
        if self.zero_stage == 1:
            self._store_gradients(grads)
        grads = self._reduce_scatter(grads, variables)
        if self.zero_stage >= 2:
            self._store_gradients(grads)
        return grads

    def _store_gradients(self, grads):
        if self.accumulation_steps == 1:
            for buffer, grad in zip(self.gradient_buffers, grads):
                buffer.assign(grad)

    def _all_reduce(self, grads, variables):
        """Averages the gradients over the data axis, one call per bucket."""
        out = list(grads)
        overlap = self.backward_overlap
        for bucket in self.buckets:
            averaged = None
            if overlap is not None:
                averaged = overlap.take(
                    bucket, [grads[i] for i in bucket.indices(variables)]
                )
            if averaged is None:
                bucket.all_reduce(
                    grads, variables, out, self._data_adapter, self._codec
                )
            else:
                bucket.place(averaged, variables, out)
        if overlap is not None:
            overlap.end_step()
        return out

    def _reduce_scatter(self, grads, variables):
        """Each rank's partition of the averaged gradients, per bucket.

        Gradients of variables without a partition axis are all-reduced.
        Under ZeRO-3 the partitioned gradients arrive reduced already.
        """
        out = list(grads)
        adapter = self._data_adapter
        for bucket in self.buckets:
            if not bucket.partitioned:
                bucket.all_reduce(grads, variables, out, adapter, self._codec)
            elif self.zero_stage != 3:
                bucket.reduce_scatter(
                    grads, variables, out, adapter, self._codec
                )
        return out

    def _all_gather(self, partitions, variables):
        """Rebuilds every partitioned variable from all ranks' partitions."""
        out = {}
        for bucket in self.buckets:
            if bucket.partitioned:
                bucket.all_gather(
                    partitions, variables, out, self._data_adapter
                )
        return out

    def _update(self, grads):
        """Clips, updates this rank's partitions, gathers the parameters."""
        variables = model_variables_of(self)
        grads = clipped(
            grads,
            variables,
            self._placement,
            self._world_adapter,
            self.clip_norm,
            self.global_clip_norm,
        )
        if self.zero_stage in (0, 3):
            self.inner_optimizer.apply(grads, variables)
            return
        adapter = self._data_adapter
        rank = adapter.rank()
        parts = adapter.size()
        bound = []
        for variable, grad in zip(variables, grads):
            axis = self.partition_axes[id(variable)]
            if axis is None:
                continue
            bound.append(
                (variable, partition(variable.value, axis, rank, parts))
            )
        with bind_values(bound) as scope:
            self.inner_optimizer.apply(grads, variables)
            partitions = [
                scope.get_current_value(v)
                if self.partition_axes[id(v)] is not None
                else None
                for v in variables
            ]
        for i, full in self._all_gather(partitions, variables).items():
            variables[i].assign(full)

    def finalize_variable_values(self, var_list):
        """Writes the EMA weights at the end of `fit()` (`use_ema`)."""
        inner = self.inner_optimizer
        if not inner.use_ema:
            return
        placement = self._placement
        for variable in var_list:
            average = moving_average(inner, variable)
            placement.assign_full_value(variable, placement.full_value(average))

    @property
    def overlaps(self):
        """Whether buckets may be sent during the backward pass (`overlap`
        and DDP: stage 0, no compression, one micro-batch per update, one
        level of reduction)."""
        return (
            self.overlap
            and self.zero_stage == 0
            and self.compression is None
            and self.accumulation_steps == 1
            and not isinstance(self._data_adapter, HierarchicalAdapter)
        )

    # Monitoring ---------------------------------------------------------

    def bucket_timeline(self):
        """When each bucket of the last step was ready and finished.

        Returns:
            A list of `{"bucket", "first_ready", "ready", "finished"}` in
            seconds since the step started (see `BackwardOverlap.timeline`)
            for the buckets sent during the backward pass; empty where
            none were.
        """
        if self.backward_overlap is None:
            return []
        return self.backward_overlap.timeline()

    def sharding_info(self):
        """Stage and bucket layout (see `get_gradient_sharding_info`)."""
        if not self.built:
            raise ValueError(
                "The optimizer is not built yet: train one step first (or "
                "call `optimizer.build(model.trainable_variables)`)."
            )
        return {
            "zero_stage": self.zero_stage,
            "data_parallel": self.data_parallel,
            "bucket_cap_mb": self._cap_mb,
            "link_probe": (
                None if self.link_probe is None else self.link_probe.describe()
            ),
            "gradient_accumulation_steps": self.accumulation_steps,
            "compression": self.compression,
            "overlap": self.backward_overlap is not None,
            "hosts": (
                self._data_adapter.hosts
                if isinstance(self._data_adapter, HierarchicalAdapter)
                else 1
            ),
            "buckets": [
                entry for bucket in self.buckets for entry in bucket.describe()
            ],
            "unpartitioned_variables": [
                v.path
                for v in model_variables_of(self)
                if self.zero_stage and self.partition_axes[id(v)] is None
            ],
        }

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "zero_stage": self.zero_stage,
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_accumulation_steps": self.accumulation_steps,
            "compression": (
                None
                if self.compression is None
                else self.compression.get_config()
            ),
            "overlap": self.overlap,
            "hierarchical": self.hierarchical,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)
