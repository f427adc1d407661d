"""What every backend runtime provides to `TensorParallelKeras`."""

import contextlib
import logging
import time

import keras
import numpy as np

from keras_tp.errors import check_count
from keras_tp.runtime.pieces import CheckpointPieces

logger = logging.getLogger(__name__)


class Runtime(CheckpointPieces):
    """What `TensorParallelKeras` talks to: the devices, the storage of the
    variables, and how Keras' steps run on them.

    Two families subclass it: `MeshRuntime` (`keras_tp.runtime.mesh`), the
    `data x model` mesh of tensor and data parallelism, with one subclass
    per backend; and `PipelineRuntime` (`keras_tp.pipeline.runtime`), the
    stages of a pipeline, each a `MeshRuntime` of its devices. The model
    class, the plan and the optimizer speak this interface only.

    Args:
        config: the `keras_tp.ParallelConfig`; its `world_size` of `None`
            means every device there is.

    Attributes:
        config: the config on the chosen devices.
        devices: the names of the devices (on torch, of the ranks).
        placement: the `Placement` of every variable; this runtime is its
            storage (`place_variable`, `place_variable_like`).
        stats: the `CommunicationStats` every collective counts in.
    """

    backend = None
    # Why this runtime's loss needs an LM head's logits whole (see
    # `keras_tp.vocab_parallel`), or `None` where it reads them split.
    whole_logits_reason = None
    pipeline_parallel = 1
    # Whether each rank runs the code between split layers on its own
    # slices (so `auto_plan` must check the plan for that).
    local_ranks = True
    # Whether the runtime stores a variable split by blocks
    # (`Column(blocks=b)`) permuted, as `keras_tp.blocks` lays it out, in
    # its steps, full values and checkpoints; elsewhere a fused projection
    # laid out block by block stays a gathering Column.
    stores_blocks = False
    # What `compile(jit_compile=...)` defaults to; Keras' "auto" enables XLA
    # where the backend can compile the whole step.
    jit_compile_default = "auto"
    # The runtime a `CoordinatedOptimizer` binds to, or `None` where the
    # plain optimizer updates the placed variables.
    optimizer_runtime = None
    # Whether the batches Keras' steps get are this process's share of
    # each global batch (`keras_tp.data_shares`), not the global batch.
    batches_are_shares = False

    @property
    def partitions_variables(self):
        """Whether ZeRO partitions variables over a data axis of 2 or more
        ranks."""
        return self.zero_stage > 0 and self.data_parallel > 1

    @property
    def coordinating_runtime(self):
        """The runtime a `CoordinatedOptimizer` binds to where an optimizer
        needs whole variables (`compiling.coordinated`); `None` where
        the runtime compiles its stages' optimizers itself."""
        return self

    @property
    def updates_pieces(self):
        """Whether the optimizer updates each rank's pieces of split or
        ZeRO-partitioned variables, not whole arrays."""
        pieces = self.tensor_parallel > 1 or self.partitions_variables
        return self.local_ranks and pieces

    def __init__(self, config):
        devices = select_devices(
            self.backend,
            self._available_devices(),
            config.requested_world_size,
            config.device_ids,
        )
        self.config = config = config.on_devices(devices)
        self.devices = devices
        self.world_size = len(devices)
        self.data_parallel = config.data_parallel
        self.tensor_parallel = config.tensor_parallel
        self.zero_stage = config.zero_stage
        # The config checked that this backend runs it (see
        # `keras_tp.config.SUPPORT`).
        self.sequence_parallel = config.sequence_parallel

    def stage_plans(self, plan):
        """`(part of plan, runtime)` pairs that install the plan's regions:
        here the whole plan, run by this runtime (a pipeline gives each
        stage's part to the runtime of its devices)."""
        return [(plan, self)]

    def prepare_trainer(self, trainer):
        """Called once with the `TensorParallelKeras` that runs the steps."""

    def check_compiled(self, trainer):
        """Called when `trainer` is compiled; refuses what cannot run."""

    def _available_devices(self):
        raise NotImplementedError

    def weights_held_by_graph(self, model):
        """`{id(variable): operation name}` of the variables of `model`
        whose storage a constant of its graph reads (a view taken when the
        model was built, which a split would leave on the old storage);
        none where constants are copies."""
        return {}

    def place_variable_like(self, variable, reference, data_axis):
        """Backend part of `Placement.place_like`."""
        raise NotImplementedError

    def place_variable(self, variable, axis):
        """Backend part of `Placement.place`: the variable holds its shard."""
        raise NotImplementedError

    def full_value(self, variable):
        """The unsplit value of a placed variable, as a NumPy array."""
        return keras.ops.convert_to_numpy(variable.value)

    def assign_full_value(self, variable, value):
        """Assigns an unsplit `value` to a placed variable."""
        variable.assign(value)

    def save_model(self, model, filepath, **kwargs):
        """Writes the unsplit `model` with its current weights, and its
        optimizer's state where it holds the optimizer (a keras-hub task
        compiled by its own `compile`)."""
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += optimizer.variables
        variables = [v for v in variables if self.placement.is_placed(v)]
        self._write_unsplit(
            model, variables, lambda: model.save(filepath, **kwargs)
        )

    def _write_unsplit(self, model, variables, write):
        """Runs `write` (a Keras save of `model`) where the placed
        `variables` it writes read whole.

        The default runs it as it is; runtimes whose ranks hold shards
        assemble the full values for the time of the write, on the one
        process that writes.
        """
        write()

    def check_batch_size(self, size):
        """Raises unless a global batch of `size` splits over the data axis.

        Training needs it; `predict()` and `evaluate()` pad such a batch
        instead (`keras_tp.runtime.padding`), but for pipelines.
        """
        if not size % self.data_parallel:
            return
        parts = self.data_parallel
        if self.pipeline_parallel > 1:
            raise ValueError(
                f"A batch of {size} samples cannot be split evenly over "
                f"data_parallel={parts} pipeline replicas. Pipelines split "
                "each batch over the replicas without padding it, in "
                "predict() and evaluate() too: use a batch size that "
                f"divides by {parts}, and a number of samples that the "
                "batch size divides (or pad your inputs to such a number "
                "and drop the extra predictions)."
            )
        raise ValueError(
            f"A batch of {size} samples cannot be split evenly "
            f"over data_parallel={parts} ranks for training (predict() and "
            "evaluate() pad such a batch; training on padded rows would "
            "change the gradients). Use a batch size (and a dataset size, "
            f"or `drop_remainder=True`) that divides by {parts}."
        )

    def step_function(self, function):
        """Keras' compiled step `function`, as Keras' loops call it: the
        JAX runtime makes global arrays of the batches where each process
        reads its share (`data_row`)."""
        return function

    def data_row(self):
        """`(row, rows)`: this process reads the `row`-th `1/rows` of each
        global batch (`keras_tp.data_shares`); `None` (the default) where
        it reads every batch whole."""
        return None

    @contextlib.contextmanager
    def reading_shares(self, shares):
        """Context in which Keras' steps get this process's share of each
        global batch (`shares=True`) or the global batch, to slice."""
        before = self.batches_are_shares
        self.batches_are_shares = shares
        try:
            yield
        finally:
            self.batches_are_shares = before

    def device_bytes(self, variables):
        """`{device: bytes}` these variables occupy, read from the arrays."""
        raise NotImplementedError

    def scope(self):
        """Context in which the model is wrapped and compiled.

        The default does nothing; a runtime whose backend needs its own
        scope (a `tf.distribute` strategy, say) returns it here.
        """
        return contextlib.nullcontext()

    def prepare_step_state(self, variables):
        """Called with every variable a step reads, before Keras makes it.

        The default does nothing; a runtime that compiles its steps for the
        placement of their inputs places every variable, so that no input
        changes placement after the first step (which would compile the
        step again).
        """

    def run_step(self, phase, step, *args, **kwargs):
        """Runs one Keras step function (`train_step`, ...) of `phase`.

        The default records the step's collectives under `phase` and calls
        Keras' own step; runtimes override it when their backend's step
        needs more (replica context, say).
        """
        with self.stats.recording(phase):
            return step(*args, **kwargs)

    def prepare_model(self, model):
        """Called once with the model when its plan is installed; no-op."""

    def run_split_function(self, function, args, split_axes, output_axis=None):
        """Runs `function(adapter, *args)` on each model rank's part of args.

        Argument `i` is split over the `model` axis along `split_axes[i]`
        (`None`: whole on every rank). The default, for ranks that hold
        their own tensors, calls the function on them; a runtime of global
        arrays maps it over its devices.

        Args:
            function: a function of the `model`-axis adapter and `args`.
            args: the tensors.
            split_axes: for each of `args`, the axis it is split on.
            output_axis: the axis the result is split on, or `None`: the
                result is the same on every rank.
        """
        return function(self.adapter, *args)


def select_devices(backend, available, world_size, device_ids):
    """The devices a runtime of `world_size` uses, by name.

    Args:
        backend: the Keras backend's name, for messages.
        available: the names of the devices (or ranks) there are.
        world_size: how many to use; `None` means all.
        device_ids: explicit names, or `None`.

    Returns:
        The list of device names.
    """
    if device_ids is not None:
        device_ids = [str(d).lower() for d in device_ids]
        missing = [d for d in device_ids if d not in available]
        if missing:
            raise ValueError(
                f"device_ids {missing} are not available on the "
                f"{backend} backend; available: {available}."
            )
        if world_size is not None and world_size != len(device_ids):
            raise ValueError(
                f"world_size={world_size} but {len(device_ids)} "
                "device_ids were given; pass one or make them agree."
            )
        devices = device_ids
    else:
        if world_size is None:
            world_size = len(available)
        check_count("world_size", world_size)
        if world_size > len(available):
            raise ValueError(
                f"world_size={world_size} is larger than the "
                f"{len(available)} {backend} device(s) available "
                f"({available}). keras_tp never runs several ranks on one "
                "device. On a CPU machine call "
                f"`keras_tp.configure_virtual_devices({world_size})` "
                "before any Keras operation, or lower world_size."
            )
        devices = available[:world_size]
    return devices


def largest_difference(copies):
    """Largest absolute difference within groups of copies of one piece.

    Args:
        copies: `{piece: [arrays that must be equal]}`.

    Returns:
        The largest difference to the first copy of its group, as a float.
    """
    worst = 0.0
    for group in copies.values():
        for other in group[1:]:
            difference = np.abs(np.asarray(other, "float64") - group[0])
            worst = max(worst, float(difference.max(initial=0.0)))
    return worst


def median_seconds(call, repeats):
    """Median wall time of `call()` over `repeats` calls after a warm-up.

    `call` must return only once its work is done (block on the result).
    """
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
