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

Gradients outlive the step only to accumulate micro-batches
(`gradient_accumulation_steps > 1`); otherwise what each device keeps
between steps is its parameters and optimizer state, as in plain Keras.

Stages 0 to 2 can compress what they send (`compression.py`).

Local SGD (`local_sgd_steps=H`) trades the per-step synchronisation for
one every `H` steps: each replica updates its own parameters from its own
gradients, and every `H`-th step the replicas average their parameters,
or (DiLoCo) hand the average of their moves to an outer optimizer.
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
    """Wraps a Keras optimizer for data parallelism, ZeRO and local SGD.

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
            keeping only a partition of the gradient is their point. The
            sums live in `gradient_buffers` between steps; with 1 (the
            default) there are none, and each step's gradients are
            dropped once applied, as in plain Keras.
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
        local_sgd_steps: `None` (default) synchronises the gradients at
            every step. An integer `H >= 1` runs local SGD instead: each
            data-parallel replica updates its own parameters from its own
            gradients, without communicating, and every `H`-th update
            (when `iterations` divides by `H`) the replicas synchronise
            their parameters with one all-reduce per bucket, `1 / H` of
            DDP's traffic. The optimizer's state (momenta) stays each
            replica's own. `fit()` ends on a synchronisation, so the
            replicas agree afterwards. Stage 0 only, without compression
            or gradient accumulation.
        outer_optimizer: with `local_sgd_steps`, a new Keras optimizer
            that makes the synchronisation a step of its own (DiLoCo,
            Douillard et al. 2023): it applies the replicas' mean move
            since the last synchronisation, `anchor - mean(parameters)`,
            as a gradient to the anchor (the parameters after the last
            synchronisation), and every replica starts from the new
            anchor. `None` averages the parameters (plain local SGD),
            which `keras.optimizers.SGD(1.0)` would do too.
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

    # DiLoCo: 4 replicas step alone with AdamW and synchronise every 50
    # steps through an outer Nesterov SGD.
    tp = keras_tp.TensorParallelKeras(model, world_size=4, data_parallel=4)
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.AdamW(1e-3), local_sgd_steps=50,
        outer_optimizer=keras.optimizers.SGD(0.7, momentum=0.9,
                                             nesterov=True))
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
        local_sgd_steps=None,
        outer_optimizer=None,
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
        _check_local_sgd(
            local_sgd_steps,
            outer_optimizer,
            optimizer,
            zero_stage,
            compression,
            gradient_accumulation_steps,
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
        self.local_sgd_steps = local_sgd_steps
        self.outer_optimizer = outer_optimizer
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
        self._model_adapter = None
        self._run_on_ranks = None
        # Local SGD with an outer optimizer: the parameters after the last
        # synchronisation.
        self.anchors = []

    def bind(
        self,
        placement,
        data_adapter,
        world_adapter,
        time_all_reduce=None,
        model_adapter=None,
        run_on_ranks=None,
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
            model_adapter: the adapter of the `model` axis, over which
                local SGD takes the norms of its clipping (each replica
                clips its own gradients).
            run_on_ranks: the runtime's `run_on_ranks`, with which local
                SGD synchronises the replicas at the end of `fit()`.
        """
        if self._placement is not None and self._placement is not placement:
            raise ValueError(
                f"CoordinatedOptimizer '{self.name}' already belongs to "
                "another TensorParallelKeras model; compile with a new one."
            )
        if self.local_sgd_steps is not None and placement.data_parallel == 1:
            raise ValueError(
                "local_sgd_steps synchronises data-parallel replicas, but "
                "the model has data_parallel=1. Build the TensorParallelKeras "
                "model with data_parallel > 1, or pass local_sgd_steps=None."
            )
        self._placement = placement
        self._data_adapter = data_adapter
        self._world_adapter = world_adapter
        self._model_adapter = model_adapter
        self._run_on_ranks = run_on_ranks
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
            if self.local_sgd_steps is not None:
                # Each replica's optimizer state is its own (DiLoCo).
                placement.keep_per_replica(slot)

        place_slots_on_creation(self.inner_optimizer, placed)
        self.inner_optimizer.build(var_list)
        self.gradient_buffers = []
        if self.local_sgd_steps is not None:
            self._build_local_sgd(var_list)
            super().build(var_list)
            return
        if self.accumulation_steps > 1:
            self._build_accumulation(var_list)
        # Errors and PowerSGD's `Q`s are optimizer variables, so that
        # checkpoints keep them.
        self._codec = (
            None
            if self.compression is None
            else make_codec(self.compression, self, var_list)
        )
        super().build(var_list)

    def _build_accumulation(self, var_list):
        """The buffers in which micro-batches accumulate, and their counter.

        Only gradient accumulation keeps gradients between steps: with one
        micro-batch per update, the step's gradients are applied and
        dropped, as plain Keras does. DDP and ZeRO-1 accumulate each
        rank's whole local gradient; ZeRO-2 and 3 the rank's partition of
        the reduced gradient (whole for a variable without a partition
        axis).
        """
        placement = self._placement
        for variable in var_list:
            buffer = self.add_variable_from_reference(variable, "gradient")
            axis = self.partition_axes[id(variable)]
            placement.place_like(
                buffer, variable, axis if self.zero_stage >= 2 else None
            )
            self.gradient_buffers.append(buffer)
        self.micro_step = self.add_variable(
            (), initializer="zeros", dtype="int32", name="micro_step"
        )

    def _build_local_sgd(self, var_list):
        """Anchors and the outer optimizer's state; replica-local storage.

        No gradient is kept between steps: each replica applies its own at
        once. The parameters become replica-local, as the inner optimizer's
        slots did when they were made: their copies on the data ranks may
        differ.
        """
        placement = self._placement
        outer = self.outer_optimizer
        if outer is not None:
            for variable in var_list:
                anchor = self.add_variable_from_reference(variable, "anchor")
                placement.place_like(anchor, variable)
                placement.assign_full_value(
                    anchor, placement.full_value(variable)
                )
                self.anchors.append(anchor)
            place_slots_on_creation(outer, placement.place_like)
            outer.build(self.anchors)
        for variable in var_list:
            placement.keep_per_replica(variable)

    def _slot_partition_axis(self, reference_variable):
        if self.zero_stage == 0:
            return None
        return self.partition_axes.get(id(reference_variable))

    @property
    def wrapped_optimizers(self):
        """The Keras optimizers this one runs: the inner one, and local
        SGD's outer one if any."""
        if self.outer_optimizer is None:
            return [self.inner_optimizer]
        return [self.inner_optimizer, self.outer_optimizer]

    @property
    def variables(self):
        return own_optimizer_variables(self) + [
            v
            for optimizer in self.wrapped_optimizers
            for v in optimizer.variables
        ]

    @property
    def state_variables(self):
        """Variables of the optimizer state: all but the gradient buffers.

        They include the compression's errors and `Q`s. The gradient
        buffers (`gradient_buffers`) exist only with
        `gradient_accumulation_steps > 1`.
        """
        buffers = {id(b) for b in self.gradient_buffers}
        return [v for v in self.variables if id(v) not in buffers]

    @property
    def replica_state_variables(self):
        """The optimizer state each replica keeps for itself.

        Under local SGD, the inner optimizer's slots (momenta, moments),
        whose copies on the data ranks differ; empty otherwise.
        """
        return [
            v
            for v in self.inner_optimizer.variables
            if self._placement.is_per_replica(v)
        ]

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
        tensors (for ZeRO-3, of its parameter partitions). Under local SGD
        the rank updates its replica with its own gradients, and every
        `local_sgd_steps`-th update synchronises the parameters.
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
            if self.local_sgd_steps is not None:
                self._local_step(grads, trainable_variables)
                return
            if steps == 1:
                self._update(self._synchronised(grads, trainable_variables))
                return
            self._accumulate_or_update(grads, trainable_variables)

    def _local_step(self, grads, variables):
        """Local SGD: this replica's update, and every `H`-th a sync.

        The synchronisation is a pure function of the variables' values
        (a traced `cond` on JAX and TensorFlow), so its collectives run
        only on synchronisation steps, and the stats count them only there.
        """
        self._update(grads)
        synchronising = ops.equal(
            ops.mod(self.iterations, self.local_sgd_steps), 0
        )
        with self._data_adapter.stats.conditional(self._synchronised_last):
            stateful_cond(
                synchronising,
                lambda: self._synchronise_replicas(variables),
                lambda: None,
                self._synchronised_variables(variables),
            )

    def _synchronised_variables(self, variables):
        """What a synchronisation of `variables` reads and assigns."""
        touched = list(variables) + self.anchors
        if self.outer_optimizer is not None:
            touched += self.outer_optimizer.variables
        return touched

    def _synchronise_replicas(self, variables):
        """Gives every replica the parameters of the synchronisation.

        Plain local SGD averages the parameters; DiLoCo averages the
        replicas' moves since the anchor, applies them to the anchor with
        the outer optimizer, and every replica takes the new anchor. Either
        way one all-reduce per bucket sends the parameters' bytes.
        """
        values = [v.value for v in variables]
        if self.outer_optimizer is None:
            for variable, mean in zip(
                variables, self._averaged(values, variables)
            ):
                variable.assign(mean)
            return
        moves = [
            ops.subtract(anchor.value, value)
            for anchor, value in zip(self.anchors, values)
        ]
        self.outer_optimizer.apply(
            self._averaged(moves, variables), self.anchors
        )
        for variable, anchor in zip(variables, self.anchors):
            variable.assign(anchor.value)

    def _averaged(self, values, variables):
        """`values`, one per variable, averaged over the data axis."""
        out = list(values)
        for bucket in self.buckets:
            bucket.all_reduce(values, variables, out, self._data_adapter)
        return out

    def _synchronised_last(self):
        """Whether the last update synchronised the replicas."""
        return self.is_synchronisation_step(
            int(ops.convert_to_numpy(self.iterations))
        )

    def is_synchronisation_step(self, step):
        """Whether update number `step` synchronises the data axis.

        Every update does under DDP and ZeRO; under local SGD, those whose
        number divides by `local_sgd_steps`. Timing the steps of each kind
        apart (a benchmark's callback, say) shows what waiting for slow
        replicas costs.

        Args:
            step: the update's number, as `iterations` counts after it
                (the first update is 1).

        Returns:
            A Python bool.
        """
        return self.local_sgd_steps is None or step % self.local_sgd_steps == 0

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
            return self._all_reduce(grads, variables)
        return self._reduce_scatter(grads, variables)

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
        local = self.local_sgd_steps is not None
        grads = clipped(
            grads,
            variables,
            self._placement,
            self._model_adapter if local else self._world_adapter,
            self.clip_norm,
            self.global_clip_norm,
            within_replica=local,
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
        """Ends `fit()` synchronised; writes the EMA weights (`use_ema`).

        Under local SGD, if the last update did not synchronise the
        replicas, they synchronise once more (recorded under the phase
        `"final_sync"`), so the model `fit()` leaves is one model.
        """
        if self.local_sgd_steps is not None and not self._synchronised_last():
            variables = model_variables_of(self)

            def synchronise():
                with self._data_adapter.stats.labelled("optimizer"):
                    self._synchronise_replicas(variables)

            self._run_on_ranks(
                synchronise,
                self._synchronised_variables(variables),
                "final_sync",
            )
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
            and self.local_sgd_steps is None
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
            "local_sgd_steps": self.local_sgd_steps,
            "outer_optimizer": (
                None
                if self.outer_optimizer is None
                else self.outer_optimizer.name
            ),
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
            "local_sgd_steps": self.local_sgd_steps,
            "outer_optimizer": (
                None
                if self.outer_optimizer is None
                else keras.saving.serialize_keras_object(self.outer_optimizer)
            ),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        outer = config.pop("outer_optimizer", None)
        if outer is not None:
            outer = keras.saving.deserialize_keras_object(
                outer, custom_objects=custom_objects
            )
        return cls(optimizer, outer_optimizer=outer, **config)


def _check_local_sgd(
    steps, outer, optimizer, zero_stage, compression, accumulation_steps
):
    """Refuses the local SGD arguments that do not compose."""
    if steps is None:
        if outer is not None:
            raise ValueError(
                "outer_optimizer is the optimizer of local SGD's "
                "synchronisations: pass local_sgd_steps with it."
            )
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            "local_sgd_steps must be an integer >= 1 (or None to "
            f"synchronise every step), got {steps!r}."
        )
    if zero_stage != 0:
        raise ValueError(
            f"local_sgd_steps needs zero_stage=0, got {zero_stage}: each "
            "replica keeps its whole parameters and optimizer state between "
            "synchronisations, which ZeRO would partition over the data "
            "axis. Build the model and the optimizer with zero_stage=0."
        )
    if compression is not None:
        raise ValueError(
            f"compression={compression.kind!r} does not apply to local SGD, "
            "which sends parameters every local_sgd_steps steps rather than "
            "gradients every step. Pass compression=None with "
            "local_sgd_steps."
        )
    if accumulation_steps != 1:
        raise ValueError(
            "gradient_accumulation_steps does not apply to local SGD, where "
            "each replica updates from its own gradients at every step. "
            "Pass gradient_accumulation_steps=1 and a larger batch (or more "
            "local_sgd_steps)."
        )
    if optimizer.use_ema:
        raise ValueError(
            f"Optimizer '{optimizer.name}' has use_ema=True, which local SGD "
            "does not support: each replica would average its own weights. "
            "Pass use_ema=False with local_sgd_steps."
        )
    if outer is None:
        return
    if not isinstance(outer, keras.optimizers.Optimizer) or isinstance(
        outer, (CoordinatedOptimizer, keras.optimizers.LossScaleOptimizer)
    ):
        raise TypeError(
            "outer_optimizer must be a keras.optimizers.Optimizer (such as "
            f"keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)), got "
            f"{type(outer)}."
        )
    if outer is optimizer or outer.built:
        raise ValueError(
            f"outer_optimizer '{outer.name}' is the inner optimizer or "
            "already built on other variables; give local SGD a new optimizer."
        )
    options = {
        "clipnorm": outer.clipnorm,
        "global_clipnorm": outer.global_clipnorm,
        "use_ema": outer.use_ema,
        "gradient_accumulation_steps": outer.gradient_accumulation_steps,
    }
    used = sorted(name for name, value in options.items() if value)
    if used:
        raise ValueError(
            f"outer_optimizer '{outer.name}' sets {used}, which the outer "
            "step of local SGD does not support; remove them (clipvalue "
            "and weight decay work)."
        )
