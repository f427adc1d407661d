"""TensorFlow runtime: the ranks are the replicas of a `tf.distribute` strategy.

On one host the strategy is a `tf.distribute.MirroredStrategy` over the
chosen devices (GPUs, or the virtual CPUs made by
`configure_virtual_devices`); across hosts it is the
`MultiWorkerMirroredStrategy` that `configure_multi_worker()` builds from
`TF_CONFIG`. DTensor is not used.

How the pieces fit:

- **Variables.** Each Keras variable of the model keeps its full (logical)
  shape, but its storage becomes a per-replica variable
  (`synchronization=ON_READ`): one component on each device, holding that
  rank's shard, or a whole copy for a replicated variable. Replica code reads
  and updates its own component without any synchronisation. Reading a split
  variable outside replica context raises; `get_weights()`, `set_weights()`
  and `save()` go through the runtime, which assembles or splits the value.
- **Steps.** Keras' TensorFlow trainer would run its step in every replica
  and treat the replicas as data parallel: it splits each batch, divides the
  loss by the number of replicas and sums the gradients over them. For
  tensor parallelism the model is therefore not put under the strategy;
  Keras sees one device and `run_step` runs the replicas itself: every
  replica computes the forward pass on the same full batch, the loss and the
  metrics are computed once from the (replicated) output, and the gradient
  of the loss with respect to that output is sent back to every replica,
  which finishes the backward pass and updates its own shards with the
  wrapped optimizer (`TensorParallelOptimizer`). The loss is never scaled
  and no gradient goes through the optimizer's all-reduce; the gradients of
  replicated variables are broadcast from replica 0 (one collective per
  step) so that their copies stay bit-identical.
- **Sharded regions.** Inside a replica a sharded layer runs on the local
  weights with the collectives of `TensorFlowCollectiveAdapter`. Called
  outside a step (a direct `model(x)`), each sharded layer runs as its own
  small replica step and its split outputs are gathered (these gathers are
  counted in the `"call"` phase); this path gives exact outputs but no
  gradients.
"""

import concurrent.futures
import contextlib
import json
import logging
import os
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask
from keras.src.optimizers import base_optimizer

from keras_tp.collectives.base import nbytes
from keras_tp.collectives.tensorflow import TensorFlowCollectiveAdapter
from keras_tp.runtime.base import Runtime

logger = logging.getLogger(__name__)

_HOST = "/device:CPU:0"
_MULTI_WORKER_STRATEGY = None


def configure_virtual_devices(n):
    """Splits the CPU into `n` logical devices; must run before TF starts.

    Args:
        n: number of CPU devices to create.

    Raises:
        RuntimeError: if TensorFlow already runs with another number of CPU
            devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return
        raise RuntimeError(
            f"TensorFlow is already initialised with {have} CPU device(s), "
            f"so configure_virtual_devices({n}) cannot take effect. Call it "
            "right after `import keras_tp`, before any Keras or TensorFlow "
            "operation (in a notebook: restart the kernel)."
        ) from None
    if tf.config.list_physical_devices("GPU"):
        logger.info(
            "GPUs found: keras_tp will use them; the %d virtual CPU devices "
            "are only used if you pass their device_ids.",
            n,
        )


def configure_multi_worker():
    """Creates the `MultiWorkerMirroredStrategy` described by `TF_CONFIG`.

    TensorFlow only configures cross-process collectives before its first
    operation, so a multi-worker program calls this first thing, on every
    worker; `TensorParallelKeras` then uses one replica per worker device.

    Returns:
        The `tf.distribute.MultiWorkerMirroredStrategy`.

    Example:

    ```python
    # Run on each worker, with TF_CONFIG naming the cluster and this task.
    import keras_tp
    from keras_tp.runtime.tensorflow import configure_multi_worker
    configure_multi_worker()
    model = build_my_keras_model()
    tp = keras_tp.TensorParallelKeras(model)   # world_size = all replicas
    ```
    """
    global _MULTI_WORKER_STRATEGY
    if _MULTI_WORKER_STRATEGY is None:
        _MULTI_WORKER_STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()
    return _MULTI_WORKER_STRATEGY


def _tf_config_workers():
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return len(config.get("cluster", {}).get("worker", []))


def _device_name(device):
    """`cpu:1` for a local device; job and task kept for a worker's."""
    spec = tf.DeviceSpec.from_string(device)
    name = f"{spec.device_type.lower()}:{spec.device_index or 0}"
    if spec.job in (None, "localhost"):
        return name
    return f"/job:{spec.job}/task:{spec.task}/device:{name}"


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A `MirroredStrategy` whose collectives never collide with another's.

    Every `MirroredStrategy` numbers its collective groups from 1, so two of
    them in one process (two models, or 2 and 4 devices) would share group
    and instance keys and their collectives would mix. Each one here starts
    at its own base, as TensorFlow's own tests do.
    """

    _KEY_STRIDE = 100000
    _instances = 0

    def __init__(self, devices):
        _MirroredStrategy._instances += 1
        # Read by MirroredExtended when the strategy is built.
        self._collective_key_base = (
            _MirroredStrategy._instances * self._KEY_STRIDE
        )
        super().__init__(devices)


class TensorFlowRuntime(Runtime):
    """Runs tensor parallelism on the replicas of a `tf.distribute` strategy.

    The replica with id `i` is rank `i` and owns shard `i` of every split
    variable.
    """

    backend = "tensorflow"
    # The replicas run under tf.distribute, which XLA cannot compile as one
    # program (see `run_step`).
    jit_compile_default = False

    def __init__(
        self, world_size=None, device_ids=None, data_parallel=1, zero_stage=0
    ):
        if data_parallel > 1 or zero_stage > 0:
            raise NotImplementedError(
                f"data_parallel={data_parallel}, zero_stage={zero_stage}: "
                "data parallelism and ZeRO are implemented on the JAX backend "
                "only so far; on TensorFlow use data_parallel=1, "
                "zero_stage=0 (tensor parallelism), or switch KERAS_BACKEND "
                "to jax."
            )
        super().__init__(world_size, device_ids, data_parallel, zero_stage)

    def _available_devices(self):
        if _MULTI_WORKER_STRATEGY is not None:
            return self._multi_worker_devices(_MULTI_WORKER_STRATEGY)
        if _tf_config_workers() > 1:
            raise RuntimeError(
                "TF_CONFIG describes several workers: call "
                "`keras_tp.runtime.tensorflow.configure_multi_worker()` at "
                "the start of the program, before any TensorFlow operation."
            )
        gpus = tf.config.list_logical_devices("GPU")
        devices = gpus or tf.config.list_logical_devices("CPU")
        return [_device_name(device.name) for device in devices]

    @staticmethod
    def _multi_worker_devices(strategy):
        workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
        local = [_device_name(d) for d in strategy.extended.worker_devices]
        task = strategy.cluster_resolver.task_id
        return [
            name.replace(f"/task:{task}/", f"/task:{other}/")
            for other in range(workers)
            for name in local
        ]

    def _build(self):
        if _MULTI_WORKER_STRATEGY is not None:
            strategy = _MULTI_WORKER_STRATEGY
            if self.world_size != strategy.num_replicas_in_sync:
                raise ValueError(
                    f"world_size={self.world_size}, but the multi-worker "
                    f"strategy has {strategy.num_replicas_in_sync} replicas; "
                    "leave world_size and device_ids unset."
                )
            first = strategy.cluster_resolver.task_id * len(
                strategy.extended.worker_devices
            )
        else:
            strategy = _MirroredStrategy(
                [tf.DeviceSpec.from_string(d).to_string() for d in self.devices]
            )
            first = 0
        self.strategy = strategy
        # Global replica ids of this host's replicas, in component order.
        self._local_replicas = list(
            range(first, first + len(strategy.extended.worker_devices))
        )
        self.adapter = TensorFlowCollectiveAdapter(self.tensor_parallel)

    # Variables ---------------------------------------------------------

    def place_variable(self, variable, axis):
        with tf.init_scope():
            full = keras.ops.convert_to_numpy(variable.value)
            variable._value = self._per_replica_variable(variable, full, axis)

    def _per_replica_variable(self, variable, full, axis):
        """A per-replica tf.Variable whose component `i` holds shard `i`."""
        shards = self._local_shards(full, axis)
        with self.strategy.scope():
            storage = tf.Variable(
                shards[0],
                dtype=variable.dtype,
                trainable=variable.trainable,
                name=variable.name,
                synchronization=tf.VariableSynchronization.ON_READ,
                # Reading a split variable outside a replica must fail, not
                # quietly return shard 0; a replicated one reads replica 0.
                aggregation=(
                    tf.VariableAggregation.NONE
                    if axis is not None
                    else tf.VariableAggregation.ONLY_FIRST_REPLICA
                ),
            )
        for component, shard in zip(storage.values, shards):
            component.assign(shard)
        return storage

    def _local_shards(self, full, axis):
        if axis is None:
            return [full] * len(self._local_replicas)
        pieces = np.split(full, self.tensor_parallel, axis=axis)
        return [pieces[replica] for replica in self._local_replicas]

    @staticmethod
    def _components(variable):
        storage = variable.value
        if isinstance(storage, tf.distribute.DistributedValues):
            return storage.values
        return (storage,)

    def full_value(self, variable):
        components = self._components(variable)
        axis = self.variable_axes.get(id(variable))
        if axis is None:
            return components[0].numpy()
        if len(self._local_replicas) == self.tensor_parallel:
            return np.concatenate([c.numpy() for c in components], axis=axis)
        return self._gathered_across_hosts(variable, axis)

    def _gathered_across_hosts(self, variable, axis):
        def gather():
            context = tf.distribute.get_replica_context()
            return context.all_gather(_local_read(variable), axis)

        gathered = tf.function(lambda: self.strategy.run(gather))()
        return self.strategy.experimental_local_results(gathered)[0].numpy()

    def assign_full_value(self, variable, value):
        value = np.asarray(value)
        axis = self.variable_axes.get(id(variable))
        for component, shard in zip(
            self._components(variable), self._local_shards(value, axis)
        ):
            component.assign(shard)

    def save_model(self, model, filepath, **kwargs):
        """Saves the unsplit model; on several workers only the chief writes.

        Every variable is assembled on the host for the time of the save.
        """
        with self._assembled(model.variables):
            if self._is_chief():
                model.save(filepath, **kwargs)
            else:
                logger.info(
                    "Worker is not the chief: %s not written.", filepath
                )

    def save_weights(self, model, filepath, **kwargs):
        """Saves the unsplit weights; on several workers only the chief."""
        with self._assembled(model.variables):
            if self._is_chief():
                model.save_weights(filepath, **kwargs)

    @contextlib.contextmanager
    def _assembled(self, variables):
        """Gives each placed variable a plain, full storage on the host."""
        storages = {}
        try:
            for variable in variables:
                if id(variable) not in self.variable_axes:
                    continue
                full = self.full_value(variable)
                storages[id(variable)] = (variable, variable.value)
                with tf.device(_HOST):
                    variable._value = tf.Variable(
                        full, trainable=variable.trainable, name=variable.name
                    )
            yield
        finally:
            for variable, storage in storages.values():
                variable._value = storage

    def _is_chief(self):
        return _MULTI_WORKER_STRATEGY is None or self._local_replicas[0] == 0

    def device_bytes(self, variables):
        totals = {device: 0 for device in self.devices}
        for variable in variables:
            for component in self._components(variable):
                name = _device_name(component.device)
                totals[name] = totals.get(name, 0) + nbytes(component)
        return totals

    # Steps ---------------------------------------------------------------

    def run_step(self, phase, step, *args, **kwargs):
        """Runs one train / test / predict step over the replicas.

        `step` is Keras' own step; it is not called, because it assumes data
        parallelism (see the module docstring). The runtime's step keeps its
        contract: same data format, same loss, metrics and optimizer of the
        compiled model, same returned logs or predictions.
        """
        model = step.__self__
        if model.jit_compile:
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs its replicas with "
                "tf.distribute, which XLA cannot compile as one program: "
                "call `compile(..., jit_compile=False)`."
            )
        if phase != "predict" and model.steps_per_execution > 1:
            # Keras loops such steps in a tf.while_loop, inside which
            # tf.distribute replicas fail to run (plain Keras too).
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs one step per "
                "execution: call `compile(..., steps_per_execution=1)`."
            )
        with self.adapter.stats.recording(phase):
            data = self._batch_of_first_worker(*args, **kwargs)
            if phase == "train":
                return self._train_step(model, data)
            if phase == "test":
                return self._test_step(model, data)
            return self._predict_step(model, data)

    def _batch_of_first_worker(self, data):
        """The batch every rank must see: worker 0's when there are several.

        Each worker process reads its own input; a shuffled order or other
        data on another worker would silently give its ranks other batches.
        One broadcast per input tensor (counted in the step's collectives)
        makes them all use worker 0's batch.
        """
        if len(self._local_replicas) == self.tensor_parallel:
            return data
        leaves = tf.nest.flatten(data)
        positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def from_first_worker(*tensors):
            return [self.adapter.broadcast(t, root=0) for t in tensors]

        tensors = self._on_replicas(
            from_first_worker, *[leaves[i] for i in positions]
        )
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        return tf.nest.pack_sequence_as(data, leaves)

    def _on_replicas(self, fn, *args):
        """Runs `fn` on every replica; returns this host's first result."""
        results = self.strategy.run(fn, args=args)
        return self.strategy.experimental_local_results(results)[0]

    @staticmethod
    def _replica_id():
        replica_id = (
            tf.distribute.get_replica_context().replica_id_in_sync_group
        )
        return int(tf.get_static_value(replica_id))

    def _train_step(self, model, data):
        optimizer = self._prepare_optimizer(model)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # Each replica's forward tape, kept for its backward pass.
        tapes = {}

        def forward(x):
            tape = tf.GradientTape()
            with tape:
                y_pred = model(x, training=True)
            tapes[self._replica_id()] = (tape, y_pred)
            return y_pred

        y_pred = self._on_replicas(forward, x)
        _check_no_extra_losses(model)
        # The loss is computed once, outside the replicas, so Keras neither
        # divides it by the number of replicas nor averages it over them.
        with tf.GradientTape() as loss_tape:
            loss_tape.watch(y_pred)
            loss = model._compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            scaled_loss = optimizer.scale_loss(loss)
        model._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        output_gradients = loss_tape.gradient(scaled_loss, y_pred)

        def backward_and_update(output_gradients):
            tape, local_y_pred = tapes.pop(self._replica_id())
            variables = model.trainable_variables
            gradients = tape.gradient(
                local_y_pred, variables, output_gradients=output_gradients
            )
            gradients = self._replicated_from_first_replica(
                gradients, variables
            )
            optimizer.apply(gradients, variables)

        if model.trainable_variables:
            self._on_replicas(backward_and_update, output_gradients)
        else:
            warnings.warn("The model does not have any trainable weights.")
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _replicated_from_first_replica(self, gradients, variables):
        """Gives every replica replica 0's gradients of replicated variables.

        Every replica computes the same gradient for a replicated variable,
        but TensorFlow does not promise the same bits on different devices
        (a reduction may round differently), and copies that drift apart
        are no longer one model. One broadcast per step and dtype, of all
        these gradients together, keeps the copies identical.
        """
        gradients = list(gradients)
        by_dtype = {}
        for i, (gradient, variable) in enumerate(zip(gradients, variables)):
            if (
                gradient is not None
                and self.variable_axes.get(id(variable)) is None
            ):
                gradients[i] = tf.convert_to_tensor(gradient)
                by_dtype.setdefault(gradients[i].dtype, []).append(i)
        for indices in by_dtype.values():
            pieces = [gradients[i] for i in indices]
            flat = tf.concat([tf.reshape(p, [-1]) for p in pieces], axis=0)
            flat = self.adapter.broadcast_gradient(flat, root=0)
            sizes = [int(np.prod(p.shape)) for p in pieces]
            for i, piece, part in zip(indices, pieces, tf.split(flat, sizes)):
                gradients[i] = tf.reshape(part, piece.shape)
        return gradients

    def _test_step(self, model, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._on_replicas(lambda x: model(x, training=False), x)
        _check_no_extra_losses(model)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        model._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _predict_step(self, model, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._on_replicas(lambda x: model(x, training=False), x)

    def _prepare_optimizer(self, model):
        """Wraps and builds the compiled optimizer (once) for the replicas."""
        optimizer = model.optimizer
        if not isinstance(optimizer, TensorParallelOptimizer):
            _check_optimizer_supported(optimizer, model, self)
            if optimizer.built:
                raise ValueError(
                    f"Optimizer '{optimizer.name}' is already built on other "
                    "variables. Give TensorParallelKeras.compile() a new "
                    "optimizer."
                )
            object.__setattr__(
                optimizer, "__class__", tensor_parallel_class(type(optimizer))
            )
            object.__setattr__(optimizer, "_tensor_parallel_runtime", self)
        elif optimizer._tensor_parallel_runtime is not self:
            raise ValueError(
                f"Optimizer '{optimizer.name}' belongs to another "
                "TensorParallelKeras model; compile with a new optimizer."
            )
        if not optimizer.built:

            def build():
                with keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(model.trainable_variables)
                # Iterations, learning rate and the like: a copy per replica,
                # since every replica steps its own optimizer.
                for variable in optimizer.variables:
                    if id(variable) not in self.variable_axes:
                        self.place(variable, None)

            _outside_distribution_context(build)
        return optimizer

    # Sharded regions -------------------------------------------------------

    def prepare_region(self, region):
        """Lets the region's Row layers take their input split."""
        region.accept_split_input()

    def run_region(self, region, args, kwargs):
        context = tf.distribute.get_replica_context()
        if context is not None and context.strategy is self.strategy:
            return self._local_region(region, args, kwargs)
        return self._region_outside_replicas(region, args, kwargs)

    def _local_region(self, region, args, kwargs):
        """The region's output on this replica, from its local tensors."""
        first_input = args[0] if args else None
        input_axis = region.input_axis(args)
        leaves = tf.nest.flatten((args, kwargs))
        if region.parallel_input:
            copies = {}
            for leaf in leaves:
                split = leaf is first_input and input_axis is not None
                if (
                    _is_float_tensor(leaf)
                    and not split
                    and id(leaf) not in copies
                ):
                    copies[id(leaf)] = self._copy_to_parallel(leaf)
            leaves = [copies.get(id(leaf), leaf) for leaf in leaves]
            args, kwargs = tf.nest.pack_sequence_as((args, kwargs), leaves)
        weights = [_local_read(variable) for variable, _ in region.variables()]
        with region.local_weights(weights), self.adapter.activated():
            return region.compute(*args, **kwargs)

    def _copy_to_parallel(self, x):
        mask = get_keras_mask(x)
        copy = self.adapter.copy_to_parallel(x)
        if mask is not None:
            set_keras_mask(copy, mask)
        return copy

    def _region_outside_replicas(self, region, args, kwargs):
        """Runs the region as its own replica step and gathers its outputs."""
        leaves = tf.nest.flatten((args, kwargs))
        tensor_positions = [
            i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)
        ]
        first_input = args[0] if args else None
        input_axis = region.input_axis(args)
        output_axes = region.output_axes(args, kwargs)

        def replica_step(*tensors):
            local = list(leaves)
            for position, tensor in zip(tensor_positions, tensors):
                if leaves[position] is first_input and input_axis is not None:
                    tensor = self.adapter.scatter_to_parallel(
                        tensor, input_axis
                    )
                local[position] = tensor
            local_args, local_kwargs = tf.nest.pack_sequence_as(
                (args, kwargs), local
            )
            outputs = self._local_region(region, local_args, local_kwargs)
            return _gather_split(self.adapter, outputs, output_axes)

        @tf.custom_gradient
        def sharded_call(*tensors):
            def grad(*upstream, variables=None):
                raise NotImplementedError(
                    f"Layer '{region.layer.path}' was called directly, outside "
                    "a TensorParallelKeras step, where keras_tp computes no "
                    "gradients on TensorFlow. Train with fit() or "
                    "train_on_batch()."
                )

            return self._on_replicas(replica_step, *tensors), grad

        return sharded_call(*[leaves[i] for i in tensor_positions])


class TensorParallelOptimizer:
    """Mixin that makes a Keras optimizer update tensor-parallel replicas.

    `TensorFlowRuntime` mixes it into the class of the compiled optimizer the
    first time the model trains. Each replica then applies its own gradients
    to its own components (shards, and copies of replicated variables) in
    replica context: gradients are never all-reduced, unlike the TensorFlow
    optimizer's data-parallel path, because each replica already holds the
    exact gradient of what it owns. Slot variables are split like the
    variable they belong to.
    """

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        runtime = self._tensor_parallel_runtime
        # Created whole on the host (not colocated with the per-replica
        # reference as the TensorFlow optimizer would), then split like its
        # reference, so no device holds a full slot.
        with tf.device(_HOST):
            variable = base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )
        runtime.place(
            variable, runtime.variable_axes.get(id(reference_variable))
        )
        return variable

    def _var_key(self, variable):
        # The TensorFlow optimizer keys variables by their distributed
        # container, whose handle exists only inside a replica; this path
        # always passes Keras variables, which are their own key.
        return id(variable)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for grad, variable in zip(grads, trainable_variables):
            self.update_step(grad, variable, learning_rate)

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            if self._use_weight_decay(variable):
                lr = keras.ops.cast(self.learning_rate, variable.dtype)
                wd = keras.ops.cast(self.weight_decay, variable.dtype)
                # The optimizer's `assign_sub`, as a Keras variable's would
                # compare the local shard's shape with the full shape.
                self.assign_sub(variable, variable * wd * lr)


_TENSOR_PARALLEL_CLASSES = {}


def tensor_parallel_class(optimizer_class):
    """The subclass of `optimizer_class` with `TensorParallelOptimizer`."""
    if optimizer_class not in _TENSOR_PARALLEL_CLASSES:
        _TENSOR_PARALLEL_CLASSES[optimizer_class] = type(
            f"TensorParallel{optimizer_class.__name__}",
            (TensorParallelOptimizer, optimizer_class),
            {"__module__": __name__},
        )
    return _TENSOR_PARALLEL_CLASSES[optimizer_class]


def _check_optimizer_supported(optimizer, model, runtime):
    if optimizer is None:
        raise ValueError("The model has no optimizer: compile it first.")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            "LossScaleOptimizer (mixed_float16) is not supported by "
            "keras_tp on TensorFlow yet; use float32 or bfloat16."
        )
    unsupported = {
        "clipnorm": optimizer.clipnorm,
        "global_clipnorm": optimizer.global_clipnorm,
        "use_ema": optimizer.use_ema,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
    }
    used = [name for name, value in unsupported.items() if value]
    if used:
        raise NotImplementedError(
            f"Optimizer options {used} need norms or state across shards, "
            "which keras_tp on TensorFlow does not implement yet; remove "
            "them (clipvalue works)."
        )
    for variable in model.trainable_variables:
        if variable.regularizer is not None:
            raise NotImplementedError(
                f"Variable '{variable.path}' has a regularizer; keras_tp on "
                "TensorFlow does not support regularization losses yet."
            )
        split = runtime.variable_axes.get(id(variable)) is not None
        if split and variable.constraint is not None:
            raise NotImplementedError(
                f"Split variable '{variable.path}' has a constraint, which "
                "would act on one shard; keras_tp does not support it yet."
            )


def _outside_distribution_context(fn):
    """Runs `fn` eagerly in a fresh thread, outside any `tf.distribute` context.

    Steps are traced inside Keras' replica context of the default strategy,
    where TensorFlow refuses to create another strategy's variables, even
    under `tf.init_scope()` or `merge_call`. Distribution contexts belong to
    a thread, so a short-lived thread can create them.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(fn).result()


def _check_no_extra_losses(model):
    if model.losses:
        raise NotImplementedError(
            "The model adds losses in its forward pass (add_loss or activity "
            "regularization); keras_tp on TensorFlow does not support them "
            "yet."
        )


def _gather_split(adapter, outputs, axes):
    """Gathers each output left split along its axis (`None`: replicated)."""
    if axes is None:
        return outputs
    if isinstance(axes, int):
        return adapter.all_gather(outputs, axes)
    return type(outputs)(
        _gather_split(adapter, o, a) for o, a in zip(outputs, axes)
    )


def _local_read(variable):
    """This replica's value of a Keras variable, as a tensor.

    `tf.identity` rather than `tf.convert_to_tensor`: a multi-worker
    collective given the latter's result takes it for the distributed
    variable itself and fails.
    """
    return tf.identity(variable.value)


def _is_float_tensor(x):
    return tf.is_tensor(x) and x.dtype.is_floating


def _batch_size(x):
    first = next(i for i in tf.nest.flatten(x) if i is not None)
    return tf.shape(first)[0]


RUNTIME = TensorFlowRuntime
