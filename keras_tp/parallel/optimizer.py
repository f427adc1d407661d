"""`CoordinatedOptimizer`: data parallelism and ZeRO around any Keras optimizer.

The optimizer runs on every rank, on that rank's tensors. Gradients of
tensor-parallel shards are already exact on their rank; what is left is the
`data` axis of the mesh, where each rank saw another slice of the batch.
The optimizer averages the gradients over it as DDP, or partitions them,
the optimizer state and the parameters as ZeRO-1, 2 or 3 (`zero.py` lays
the variables over `data` in partitions and buckets).

When the replicas synchronise (`GradientAccumulation`, `LocalSGD`), how the
buckets travel (a codec, `compression.py`) and whether the backward pass
sends them (`BackwardOverlap`) are strategies the optimizer holds.
"""

import keras
from keras import ops

from keras_tp.collectives.hierarchy import HierarchicalAdapter
from keras_tp.keras_internals import model_variables_of
from keras_tp.keras_internals import moving_average
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.parallel.accumulation import GradientAccumulation
from keras_tp.parallel.bucket_probe import check_bucket_cap_mb
from keras_tp.parallel.bucket_probe import chosen_cap_mb
from keras_tp.parallel.bucket_probe import probe_for
from keras_tp.parallel.clipping import NormClipping
from keras_tp.parallel.compression import gradient_compression
from keras_tp.parallel.compression import make_codec
from keras_tp.parallel.local_sgd import local_sgd
from keras_tp.parallel.signs import frozen_by
from keras_tp.parallel.wrapping import WrappingOptimizer
from keras_tp.parallel.zero import ZeroLayout

# The default most megabytes of gradient per collective call.
BUCKET_CAP_MB = 25


class CoordinatedOptimizer(WrappingOptimizer):
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
            every step. An integer `H >= 1` runs local SGD instead
            (`keras_tp.parallel.local_sgd.LocalSGD`): each data-parallel
            replica updates its own parameters from its own gradients,
            and every `H`-th update the replicas synchronise their
            parameters, `1 / H` of DDP's traffic. `fit()` ends on a
            synchronisation. Stage 0 only, without compression or
            gradient accumulation.
        outer_optimizer: with `local_sgd_steps`, a new Keras optimizer
            that makes the synchronisation a step of its own (DiLoCo): it
            applies the replicas' mean move since the last
            synchronisation to the parameters after it. `None` averages
            the parameters (plain local SGD).
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
        bucket_cap_mb=BUCKET_CAP_MB,
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
            raise ValueError(
                "A LossScaleOptimizer wraps the CoordinatedOptimizer, not "
                "the other way round: pass LossScaleOptimizer("
                "CoordinatedOptimizer(...)) to compile()."
            )
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}."
            )
        check_bucket_cap_mb(bucket_cap_mb)
        accumulation = GradientAccumulation(
            gradient_accumulation_steps, zero_stage, optimizer
        )
        if optimizer.built:
            raise ValueError(
                f"Optimizer '{optimizer.name}' is already built on other "
                "variables; give CoordinatedOptimizer a new optimizer."
            )
        compression = gradient_compression(compression, zero_stage)
        local = local_sgd(
            local_sgd_steps,
            outer_optimizer,
            optimizer,
            zero_stage,
            compression,
            gradient_accumulation_steps,
        )
        super().__init__(optimizer, name or f"coordinated_{optimizer.name}")
        self.zero_stage = zero_stage
        self.bucket_cap_mb = bucket_cap_mb
        # Not `gradient_accumulation_steps`: Keras' base optimizer would
        # build its own accumulators from that attribute.
        self.accumulation_steps = gradient_accumulation_steps
        self.local_sgd_steps = local_sgd_steps
        self.outer_optimizer = outer_optimizer
        # When the replicas synchronise, the one strategy that decides.
        self.synchronisation = local or accumulation
        self.gradient_buffers = []
        # What `bucket_cap_mb="auto"` measured, once bound to a mesh.
        self.link_probe = None
        self.compression = compression
        self._codec = None
        self.overlap = overlap
        # The runtime's `BackwardOverlap`, once it has attached one.
        self.backward_overlap = None
        self.clipping = NormClipping(optimizer)
        # The runtime binds a `HierarchicalAdapter` as the `data` adapter.
        self.hierarchical = hierarchical
        self._placement = None
        self._data_adapter = None

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
            placement: the `Placement` of the model's variables.
            data_adapter: the collective adapter of the `data` axis (a
                `HierarchicalAdapter` for `hierarchical=True`).
            world_adapter: the adapter over the whole mesh.
            time_all_reduce: the runtime's timer of an all-reduce over
                `data`, for `bucket_cap_mb="auto"` (`probe_link`).
            model_adapter: the adapter of the `model` axis, over which
                each replica of local SGD clips its own gradients.
            run_on_ranks: the runtime's `run_on_ranks`, with which local
                SGD synchronises the replicas at the end of `fit()`.
        """
        if self._placement is not None and self._placement is not placement:
            raise ValueError(
                f"CoordinatedOptimizer '{self.name}' already belongs to "
                "another TensorParallelKeras model; compile with a new one."
            )
        self.synchronisation.bind(placement, data_adapter, run_on_ranks)
        self._placement = placement
        self._data_adapter = data_adapter
        local = self.synchronisation.replica_local
        world = model_adapter if local else world_adapter
        self.clipping.bind(placement, world, within_replica=local)
        if self.link_probe is None:
            self.link_probe = probe_for(
                self.bucket_cap_mb, placement.data_parallel, time_all_reduce
            )

    def build(self, var_list):
        if self._placement is None:
            raise ValueError(
                "CoordinatedOptimizer only runs inside a TensorParallelKeras "
                "model: pass it to `TensorParallelKeras.compile()`."
            )
        placement = self._placement
        var_list = list(var_list)
        cap_mb = chosen_cap_mb(self.bucket_cap_mb, self.link_probe)
        self.layout = ZeroLayout(
            placement, var_list, self.zero_stage, cap_mb * 2**20
        )
        axes = self.layout.partition_axes
        self.buckets = self.layout.buckets
        replica_local = self.synchronisation.replica_local

        def placed(slot, reference):
            placement.place_like(slot, reference, axes.get(id(reference)))
            if replica_local:
                # Each replica's optimizer state is its own (DiLoCo).
                placement.keep_per_replica(slot)

        place_slots_on_creation(self.inner_optimizer, placed)
        self.inner_optimizer.build(var_list)
        self.synchronisation.build(self, var_list, axes)
        self.gradient_buffers = list(self.synchronisation.gradient_buffers)
        # Errors and `Q`s are optimizer variables: checkpoints keep them.
        self._codec = make_codec(self.compression, self, placement, var_list)
        super().build(var_list)

    @property
    def wrapped_optimizers(self):
        """The Keras optimizers this one runs: the inner one, and local
        SGD's outer one if any."""
        return [self.inner_optimizer, *self.synchronisation.optimizers]

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
        per_replica = self._placement.is_per_replica
        return [v for v in self.inner_optimizer.variables if per_replica(v)]

    @property
    def compression_variables(self):
        """The state the compression keeps: errors and PowerSGD's `Q`s.

        Each rank's error is its own (a row per data rank); a `Q` is the
        same on every data rank. Empty without compression or for the
        16-bit casts, which keep none.
        """
        return [] if self._codec is None else list(self._codec.variables)

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
        with self._data_adapter.stats.labelled("optimizer"):
            self.synchronisation.apply(self, grads, trainable_variables)

    def synchronised_gradients(self, grads, variables):
        """The gradients every rank uses, each of its own partition
        (DDP, ZeRO: see `ZeroLayout.synchronised`).

        Args:
            grads: this rank's gradients of `variables`.
            variables: the trainable variables.
        """
        # The backward pass's all-reduces, where the runtime started them.
        codec = self.backward_overlap or self._codec
        return self.layout.synchronised(
            grads, variables, self._data_adapter, codec
        )

    def update_parameters(self, grads):
        """Clips, updates this rank's partitions, gathers the parameters.

        Args:
            grads: one per trainable variable: the synchronised gradients
                (`synchronised_gradients`), or under local SGD this
                replica's own.
        """
        variables = model_variables_of(self)
        grads = self.clipping(grads, variables)
        adapter = self._data_adapter
        with frozen_by(self._codec):
            self.layout.update(self.inner_optimizer, grads, variables, adapter)

    def finalize_variable_values(self, var_list):
        """Ends `fit()` synchronised; writes the EMA weights (`use_ema`).

        Under local SGD, if the last update did not synchronise the
        replicas, they synchronise once more (recorded under the phase
        `"final_sync"`), so the model `fit()` leaves is one model.
        """
        self.synchronisation.finish(self, model_variables_of(self))
        inner = self.inner_optimizer
        if not inner.use_ema:
            return
        placement = self._placement
        # A pipeline stage's optimizer holds its own stage's averages.
        built = {id(v) for v in model_variables_of(inner)}
        for variable in (v for v in var_list if id(v) in built):
            average = moving_average(inner, variable)
            placement.assign_full_value(variable, placement.full_value(average))

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
        return self.synchronisation.synchronises(step)

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
        probe = self.link_probe
        adapter = self._data_adapter
        hierarchical = isinstance(adapter, HierarchicalAdapter)
        return {
            "zero_stage": self.zero_stage,
            "data_parallel": self._placement.data_parallel,
            "bucket_cap_mb": chosen_cap_mb(self.bucket_cap_mb, probe),
            "link_probe": None if probe is None else probe.describe(),
            "gradient_accumulation_steps": self.accumulation_steps,
            "compression": self.compression,
            "local_sgd_steps": self.local_sgd_steps,
            "outer_optimizer": getattr(self.outer_optimizer, "name", None),
            "overlap": self.backward_overlap is not None,
            "hosts": adapter.hosts if hierarchical else 1,
            **self.layout.describe(model_variables_of(self)),
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
            # `None` serialises, and deserialises, to `None`.
            "compression": self.compression and self.compression.get_config(),
            "overlap": self.overlap,
            "hierarchical": self.hierarchical,
            "local_sgd_steps": self.local_sgd_steps,
            "outer_optimizer": keras.saving.serialize_keras_object(
                self.outer_optimizer
            ),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        outer = keras.saving.deserialize_keras_object(
            config.pop("outer_optimizer", None), custom_objects=custom_objects
        )
        return cls(optimizer, outer_optimizer=outer, **config)
