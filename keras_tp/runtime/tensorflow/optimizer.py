"""Optimizer of the TensorFlow runtime: each replica updates what it holds.

`TensorParallelOptimizer` is mixed into the class of the compiled optimizer,
as Keras mixes `TFOptimizer` into its TensorFlow optimizers;
`prepare_optimizer` does so the first time the model trains.
"""

import concurrent.futures

import keras
import tensorflow as tf

from keras_tp.compiling import check_unbuilt
from keras_tp.keras_internals import UpdatesThroughAssign
from keras_tp.keras_internals import backend_free_add_variable_from_reference
from keras_tp.keras_internals import exclude_from_weight_decay
from keras_tp.keras_internals import get_stateless_scope
from keras_tp.keras_internals import mix_in
from keras_tp.keras_internals import mixed_class
from keras_tp.keras_internals import per_variable_update_steps
from keras_tp.keras_internals import untracked_variables
from keras_tp.keras_internals import weight_decay_excluded
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.runtime.tensorflow.devices import HOST
from keras_tp.runtime.tensorflow.storage import local_read
from keras_tp.tensors import collect_flat
from keras_tp.tensors import is_float


def prepare_optimizer(runtime, model):
    """Wraps and builds the compiled optimizer (once) for the replicas.

    With a data axis or ZeRO the compiled optimizer is a
    `CoordinatedOptimizer`; it and the optimizers it runs (the inner one,
    local SGD's outer one) all become `TensorParallelOptimizer`s, the
    `CoordinatedOptimizer` placing its slots and (when it accumulates
    micro-batches) gradient buffers with their ZeRO partitions.

    Args:
        runtime: the `TensorFlowRuntime` whose replicas run the optimizer.
        model: the compiled `TensorParallelKeras` model.

    Returns:
        The model's optimizer, a `TensorParallelOptimizer`.
    """
    optimizer = model.optimizer
    if not isinstance(optimizer, TensorParallelOptimizer):
        _check_optimizer_supported(optimizer)
        # Built before its first step: on another model's variables.
        check_unbuilt(optimizer)
        for each in _optimizers_run_by(optimizer):
            excluded = weight_decay_excluded(
                each, model.trainable_variables, runtime.former_keys
            )
            mix_in(
                each,
                tensor_parallel_class(type(each)),
                _tensor_parallel_runtime=runtime,
            )
            # Keyed by identity now (`UpdatesThroughAssign._var_key`).
            exclude_from_weight_decay(each, excluded)
    elif optimizer._tensor_parallel_runtime is not runtime:
        raise ValueError(
            f"Optimizer '{optimizer.name}' belongs to another "
            "TensorParallelKeras model; compile with a new optimizer."
        )
    if not optimizer.built:

        def build():
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(model.trainable_variables)
            # Iterations, learning rate and the like: a copy per replica,
            # since every replica steps its own optimizer; so are the
            # variables an optimizer keeps without listing them (Nadam's
            # product of momenta), which each replica advances.
            held = [
                variable
                for each in _optimizers_run_by(optimizer)
                for variable in untracked_variables(each)
            ]
            for variable in [*optimizer.variables, *held]:
                if not runtime.placement.is_placed(variable):
                    runtime.placement.place(variable, None)

        _outside_distribution_context(build)
    return optimizer


class ReplicaUpdates:
    """`TensorFlowRuntime` mixin: each replica's update of its pieces."""

    def build_optimizer(self, model):
        prepare_optimizer(self, model)

    def apply_on_replica(
        self, optimizer, gradients, variables, model, synchronised=False
    ):
        """Updates this replica's pieces of `variables` (in a replica).

        Args:
            optimizer: the model's `TensorParallelOptimizer`.
            gradients: this replica's gradients of `variables`.
            variables: trainable variables of `model`.
            model: the model whose non-trainable float state is averaged
                over the data axis after the update.
            synchronised: whether `gradients` are those that a
                `CoordinatedOptimizer` synchronised from `replica_gradients`
                (`synchronised_gradients`): it only applies them.
        """
        if synchronised:
            # As `CoordinatedOptimizer.apply` labels its collectives.
            with self.data_adapter.stats.labelled("optimizer"):
                optimizer.update_parameters(gradients)
        else:
            gradients = self.replica_gradients(gradients, variables)
            optimizer.apply(gradients, variables)
        if self.per_rank_steps:
            self._average_non_trainables(model)

    def replica_gradients(self, gradients, variables):
        """This replica's `gradients` of `variables` as its optimizer takes
        them: dense; a replicated variable's, the first replica's."""
        if self.per_rank_steps:
            gradients = _dense(gradients)
        if self.tensor_parallel > 1:
            gradients = self._replicated_from_first_replica(
                gradients, variables
            )
        return gradients

    def _replicated_from_first_replica(self, gradients, variables):
        """Gives every model rank the gradients of replicated variables
        that model rank 0 computed.

        Every rank computes the same gradient for a replicated variable,
        but TensorFlow does not promise the same bits on different devices
        (a reduction may round differently), and copies that drift apart
        are no longer one model. One broadcast per step and dtype, of all
        these gradients together, keeps the copies identical.
        """
        gradients = list(gradients)
        replicated = [
            i
            for i, (gradient, variable) in enumerate(zip(gradients, variables))
            if gradient is not None
            and self.placement.split_axis(variable) is None
        ]
        broadcast = collect_flat(
            [tf.convert_to_tensor(gradients[i]) for i in replicated],
            lambda flat: self.adapter.broadcast_gradient(flat, root=0),
        )
        for i, gradient in zip(replicated, broadcast):
            gradients[i] = gradient
        return gradients

    def _average_non_trainables(self, model):
        """Averages the non-trainable float state over the data axis.

        BatchNorm statistics, say, which each row updated from its own
        slice of the batch; one all-reduce for all of them per dtype.
        """
        averaged = [
            variable
            for variable in model.non_trainable_variables
            if is_float(variable)
            and self.placement.is_placed(variable)
            and id(variable) not in self.placement.data_axes
        ]
        means = collect_flat(
            [local_read(v) for v in averaged],
            lambda flat: self.data_adapter.all_reduce(flat, "mean"),
        )
        for variable, mean in zip(averaged, means):
            variable.assign(mean)


def _dense(gradients):
    """The gradients with `tf.IndexedSlices` (of embeddings) made dense.

    The `CoordinatedOptimizer` sums a gradient over the data axis, which
    merges the rows of a token seen several times, as on JAX and torch.
    Keras on one device keeps the slices apart, and Adam's second moment and
    gradient norms then count each occurrence.
    """
    return [
        tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        for g in gradients
    ]


class TensorParallelOptimizer(UpdatesThroughAssign):
    """Mixin that makes a Keras optimizer update tensor-parallel replicas.

    `TensorFlowRuntime` mixes it into the class of the compiled optimizer the
    first time the model trains (with a data axis or ZeRO, into the
    `CoordinatedOptimizer` and the optimizer it wraps). Each replica then
    applies its own gradients to its own components (shards, partitions,
    and copies of replicated variables) in replica context: gradients are
    never all-reduced by the TensorFlow optimizer's data-parallel path,
    because each replica already holds the exact gradient of what it owns
    (the `CoordinatedOptimizer` synchronises the data axis itself). Slot
    variables are split like the variable they belong to.
    """

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        # Created whole on the host (not colocated with the per-replica
        # reference as the TensorFlow optimizer would), then placed like its
        # reference, so no device holds a full slot.
        with tf.device(HOST):
            return backend_free_add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )

    # A variable bound to a value (the ZeRO partition a
    # CoordinatedOptimizer updates, say) is written through Keras, which
    # records the write in the binding; any other one directly in this
    # replica's component.

    def assign(self, variable, value):
        if _is_bound(variable):
            variable.assign(value)
        else:
            super().assign(variable, value)

    def assign_add(self, variable, value):
        if _is_bound(variable):
            variable.assign_add(value)
        else:
            super().assign_add(variable, _scattered(value))

    def assign_sub(self, variable, value):
        if _is_bound(variable):
            variable.assign_sub(value)
        else:
            super().assign_sub(variable, _scattered(value))


def tensor_parallel_class(optimizer_class):
    """The subclass of `optimizer_class` with `TensorParallelOptimizer`."""
    return mixed_class(
        TensorParallelOptimizer,
        "TensorParallel",
        optimizer_class,
        per_variable_update_steps(),
    )


def _scattered(value):
    """A sparse update (`tf.IndexedSlices`) as the dense tensor it adds.

    Per-replica (`ON_READ`) components take no scatter ops; the dense sum
    of the slices changes the same rows by the same amounts (repeated rows
    add up, as a scatter does). The optimizer's own sparse arithmetic
    (Adam touching only the rows seen) happens before, unchanged.
    """
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def _is_bound(variable):
    """Whether a Keras scope binds `variable` to a value of its own."""
    scope = get_stateless_scope()
    return scope is not None and scope.get_current_value(variable) is not None


def _optimizers_run_by(optimizer):
    """`optimizer`, a loss scale's inner optimizer, and the optimizers a
    `CoordinatedOptimizer` among them runs."""
    optimizers = [optimizer]
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizers.append(optimizer.inner_optimizer)
    if isinstance(optimizers[-1], CoordinatedOptimizer):
        optimizers += optimizers[-1].wrapped_optimizers
    return optimizers


def _check_optimizer_supported(optimizer):
    if optimizer is None:
        raise ValueError("The model has no optimizer: compile it first.")
    # `compile()` makes the optimizer a CoordinatedOptimizer where replicas
    # hold shards; on whole variables Keras' norms and averages work, but
    # its accumulation calls `merge_call` inside the replica step.
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps and not isinstance(optimizer, CoordinatedOptimizer):
        raise NotImplementedError(
            f"Optimizer '{optimizer.name}' has gradient_accumulation_steps="
            f"{steps}, which Keras runs on TensorFlow outside replica steps "
            "only. Pass keras_tp.CoordinatedOptimizer(optimizer, "
            "gradient_accumulation_steps=...) to compile() instead, with an "
            "optimizer that does not accumulate itself."
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
