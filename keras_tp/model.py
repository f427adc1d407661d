"""`TensorParallelKeras`: a `keras.Model` split across devices."""

import inspect

import keras

from keras_tp import checkpoint
from keras_tp import compiling
from keras_tp import reporting
from keras_tp import weight_files
from keras_tp.checkpoint.callbacks import prepare_callbacks
from keras_tp.config import ParallelConfig
from keras_tp.first_process import FirstProcessSpeaks
from keras_tp.generation import Generation
from keras_tp.keras_internals import BuildsBeforeTracing
from keras_tp.keras_internals import RunsModelsOwnLoss
from keras_tp.keras_internals import attach_trainer_state
from keras_tp.keras_internals import print_msg
from keras_tp.parallel.batch_loss import GlobalBatchLoss
from keras_tp.parallel.reports import DataParallelReports
from keras_tp.runtime import make_runtime
from keras_tp.splitting import bind_plan
from keras_tp.splitting import check_wrappable
from keras_tp.splitting import split_model
from keras_tp.vocab_parallel import splitting_logits
from keras_tp.vocab_parallel import with_split_logits

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)


class TensorParallelKeras(
    DataParallelReports,
    Generation,
    FirstProcessSpeaks,
    BuildsBeforeTracing,
    GlobalBatchLoss,
    RunsModelsOwnLoss,
    keras.Model,
):
    """Runs a built Keras model with its layers split across devices.

    Dense, EinsumDense, convolution, embedding and attention layers are
    split column- and row-wise as Megatron-LM does, every device computes
    with its own shard, and the results match the model on one device.
    The devices form a `data x model` mesh: with `data_parallel > 1` each
    row of the mesh trains on its slice of every global batch, and the
    compiled optimizer becomes a `keras_tp.CoordinatedOptimizer` that
    averages gradients (DDP) or partitions optimizer state, gradients and
    parameters (ZeRO stages 1 to 3) over the data axis.
    Everything `keras.Model` does keeps working: `compile`, `fit` (with
    callbacks and validation), `evaluate`, `predict`, the `*_on_batch`
    methods and `__call__`.

    The wrapped model is converted in place: its split layers only run
    through this object afterwards. `get_weights()`, `set_weights()` and
    `save()` use the original model's variable order and full shapes, and
    `save()` writes the original, unsplit architecture, which plain
    `keras.saving.load_model()` opens.

    Args:
        model: a built `keras.Model` (Sequential, Functional or subclassed).
        world_size: total number of devices; defaults to all available.
        device_ids: names (`["cpu:0", "cpu:1"]`) or a Keras `DeviceMesh`.
        plan: `"auto"`, a `keras_tp.ShardingPlan`, or a dict
            `{regex on variable.path: style}`.
        data_parallel: size of the data axis; `world_size` must divide by
            it, and the tensor-parallel size is the quotient.
        zero_stage: 0 (DDP), 1 (optimizer state partitioned over the data
            axis), 2 (and gradients) or 3 (and parameters).
        pipeline_parallel: the number of pipeline stages. Above 1, the
            model (Functional) is cut into that many consecutive stages
            (`keras_tp.pipeline.split_stages`), one per device, and each
            batch runs through them as micro-batches. `data_parallel`
            replicas of the pipeline each train on a slice of the batch.
            Each stage of a replica runs on `world_size /
            (pipeline_parallel x data_parallel)` devices, split by tensor
            parallelism (a `data x pipe x model` mesh); `zero_stage=1`
            partitions the optimizer state over the replicas.
        num_microbatches: micro-batches per batch (per replica's slice of
            it) of a pipeline; `None` takes the largest divisor of the
            slice's size up to `4 * pipeline_parallel`.
        schedule: the pipeline's order of forward and backward passes,
            `"1f1b"` (default; holds at most `pipeline_parallel`
            micro-batches' activations) or `"gpipe"`.
        pipeline_cuts: names of the layers at which stages 1, 2, ...
            start; `None` cuts where the fewest activations cross,
            balancing parameters.
        sequence_parallel: whether the activations between the split
            layers (norms, dropouts, residual adds) are split on the
            sequence axis too, as Megatron's sequence parallelism splits
            them: a split layer's all-reduce becomes a reduce-scatter and
            its replicated input an all-gather, with the same bytes, and
            those activations take `1 / tensor_parallel` of the memory.
            For inputs of shape `(batch, sequence, features)` whose
            sequence length divides by the tensor-parallel size; which
            data axes, ZeRO stages and pipelines each backend runs it
            with is `keras_tp.config.SUPPORT` (the table in the docs).
        sample_batch: a few rows of the model's inputs, which the planner
            runs the model on once to trace it and check the plan; by
            default a probe batch made from its input shapes (unknown
            dimensions 8, else 128, else 1024): pass one if it fails.

    Example:

    ```python
    keras_tp.configure_virtual_devices(4)
    model = build_my_keras_model()
    tp = keras_tp.TensorParallelKeras(model, world_size=4)
    tp.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tp.fit(x, y, epochs=3)
    tp.summary()

    # 2 data-parallel rows x 2 tensor-parallel ranks, ZeRO-2
    tp = keras_tp.TensorParallelKeras(model, world_size=4, data_parallel=2,
                                      zero_stage=2)
    tp.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    tp.fit(x, y, batch_size=64)   # 64 is the global batch

    # 4 pipeline stages, 8 micro-batches of each batch, 1F1B
    tp = keras_tp.TensorParallelKeras(model, world_size=4,
                                      pipeline_parallel=4,
                                      num_microbatches=8)
    ```
    """

    def __init__(
        self,
        model,
        world_size=None,
        device_ids=None,
        plan="auto",
        data_parallel=1,
        zero_stage=0,
        pipeline_parallel=1,
        num_microbatches=None,
        schedule="1f1b",
        pipeline_cuts=None,
        sequence_parallel=False,
        sample_batch=None,
        **kwargs,
    ):
        config = ParallelConfig(
            world_size=world_size,
            device_ids=device_ids,
            data_parallel=data_parallel,
            pipeline_parallel=pipeline_parallel,
            zero_stage=zero_stage,
            sequence_parallel=sequence_parallel,
            schedule=schedule,
            num_microbatches=num_microbatches,
            pipeline_cuts=pipeline_cuts,
        )
        check_wrappable(model, config)
        runtime = make_runtime(model, config)
        name = kwargs.pop("name", f"tensor_parallel_{model.name}")
        with runtime.scope():
            super().__init__(name=name, **kwargs)
        self.model = model
        self._runtime = runtime
        self._plan = bind_plan(model, plan, runtime, sample_batch)
        self._vocab_head = None
        split_model(model, self._plan, runtime, self)
        self.built = True
        if getattr(model, "compiled", False):
            # A keras-hub task, or a model compiled before, trains as such.
            self._compile(**compiling.arguments_of(model))

    @property
    def sharding_plan(self):
        """The `ShardingPlan` applied to the model, bound to it."""
        return self._plan

    @property
    def parallel_config(self):
        """The `keras_tp.ParallelConfig` the model runs, on its devices."""
        return self._runtime.config

    @property
    def device_mesh(self):
        """The `keras.distribution.DeviceMesh` with axes `data` x `model`."""
        return self._runtime.device_mesh

    def call(self, inputs, training=None):
        return self._runtime.call_model(self.model, inputs, training)

    def get_layer(self, name=None, index=None):
        """Looks a layer up in the wrapped model (see `keras.Model`)."""
        return self.model.get_layer(name=name, index=index)

    @property
    def zero_stage(self):
        return self._runtime.zero_stage

    def compile(self, *args, **kwargs):
        """Configures training as the wrapped model's `compile` does.

        That is `keras.Model.compile`, or the wrapped model's own where its
        class defines one: a keras-hub task's fills in its loss, optimizer
        and metrics for `"auto"` (and its `generate()` settings). A model
        compiled before wrapping (as a keras-hub task is) is compiled alike.

        The optimizer may become a `keras_tp.CoordinatedOptimizer`
        (`compiling.coordinated` says where), or pass one.

        Example:

        ```python
        causal_lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        tp = keras_tp.TensorParallelKeras(causal_lm, world_size=2)
        tp.compile(optimizer="adam")  # loss and metrics: the task's own
        ```
        """
        if type(self.model).compile is not keras.Model.compile:
            args, kwargs = compiling.resolved_by_model(self.model, args, kwargs)
        self._compile(*args, **kwargs)

    def _compile(self, optimizer="rmsprop", *args, **kwargs):
        runtime, kwargs = self._runtime, compiling.by_name(args, kwargs)
        kwargs.setdefault("jit_compile", runtime.jit_compile_default)
        optimizer = compiling.optimizer_for(optimizer, runtime, self, kwargs)
        kwargs, self._vocab_head = with_split_logits(
            self.model, self._plan, runtime, kwargs
        )
        with runtime.scope():
            super().compile(optimizer, **kwargs)
        runtime.check_compiled(self)
        compiling.place_slots(self.optimizer, runtime)

    def fit(self, *args, **kwargs):
        """Trains as `keras.Model.fit` does.

        The optimizer's state is built first, laid out as the runtime
        needs it, so callbacks that restore it at the start of training
        (`keras.callbacks.BackupAndRestore`) find it in place. In a job of
        several processes, `BackupAndRestore` and `ModelCheckpoint` work
        in every process (see `keras_tp.checkpoint.callbacks`), and the
        first process speaks for the job (`keras_tp.first_process`).
        """
        arguments = _FIT_SIGNATURE.bind_partial(self, *args, **kwargs)
        prepare_callbacks(arguments.arguments.get("callbacks"), self._runtime)
        self._build_optimizer()
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """`keras.Model.train_on_batch`, with the optimizer's state built
        as the runtime lays it out (see `fit`)."""
        self._build_optimizer()
        return super().train_on_batch(*args, **kwargs)

    def _build_optimizer(self):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            self._runtime.build_optimizer(self)

    def make_train_function(self, force=False):
        return self._make_step("train", super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._make_step("test", super().make_test_function, force)

    def make_predict_function(self, force=False):
        return self._make_step("predict", super().make_predict_function, force)

    def _make_step(self, phase, make, force):
        """Keras' `make(force)` once the steps' state is placed, as the
        runtime calls it (`Runtime.step_function`)."""
        # Before compile() a Keras model may not have the attribute yet.
        optimizer = getattr(self, "optimizer", None)
        slots = optimizer.variables if optimizer else []
        state = [*self.variables, *slots, *self.metrics_variables]
        self._runtime.prepare_step_state(state)
        make(force)
        name = f"{phase}_function"
        setattr(self, name, self._runtime.step_function(getattr(self, name)))
        return getattr(self, name)

    def train_step(self, *args, **kwargs):
        step = super().train_step
        with splitting_logits(self._vocab_head):
            return self._runtime.run_step("train", step, *args, **kwargs)

    def test_step(self, *args, **kwargs):
        step = super().test_step
        with splitting_logits(self._vocab_head):
            return self._runtime.run_step("test", step, *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        step = super().predict_step
        return self._runtime.run_step("predict", step, *args, **kwargs)

    def communication_stats(self, phase="train", axis=None):
        """Collectives of the last step of `phase`, per kind.

        Args:
            phase: `"train"` (default), `"test"`, `"predict"`, `"call"`
                (a direct `__call__`) or `"final_sync"` (the
                synchronisation local SGD adds at the end of `fit()`).
            axis: only the collectives over this mesh axis: `"model"`
                (tensor parallelism), `"data"` (data parallelism and ZeRO)
                or `("data", "model")` (a global norm); `None` counts all.

        Returns:
            `{kind: {"calls", "bytes", "forward_calls", "forward_bytes",
            "backward_calls", "backward_bytes", "optimizer_calls",
            "optimizer_bytes"}}` where kind is `all_reduce`, `all_gather`,
            `reduce_scatter` or `broadcast`. Bytes are the whole buffer of
            each call (an all-gather's output); the `optimizer_*` entries
            are the gradient synchronisation and parameter gathering of a
            `CoordinatedOptimizer`.
        """
        attach_trainer_state(self)
        return self._runtime.stats.summary(phase, axis)

    def pipeline_timeline(self):
        """When each stage ran each micro-batch in the last training step.

        Measured from the run: on torch each stage's rank times its own
        passes (a collective, which every rank calls); on TensorFlow the
        traced step times its first replica's passes with `tf.timestamp`
        on the stage's device; on JAX each pass's program stamps its
        start and end with host callbacks on the stage's devices.

        Returns:
            A `keras_tp.pipeline.Timeline`, in seconds from the step's
            start: `keras_tp.pipeline.bubble_fraction(timeline)` gives
            each stage's idle share, to compare with
            `keras_tp.pipeline.ideal_bubble(P, M)`, and
            `timeline.chart()` draws it.

        Example:

        ```python
        # on each of 2 torch ranks
        tp = keras_tp.TensorParallelKeras(model, pipeline_parallel=2)
        tp.compile(optimizer="adam", loss="mse")
        tp.fit(x, y, batch_size=16, epochs=1)
        timeline = tp.pipeline_timeline()
        print(keras_tp.pipeline.bubble_fraction(timeline))
        ```
        """
        return reporting.measured_timeline(self._runtime)

    def reset_communication_stats(self):
        """Forgets the recorded collectives of every phase."""
        self._runtime.stats.reset()

    def parameter_bytes_per_device(self):
        """`{device: bytes}` of the model's variables, read from the arrays."""
        return self._runtime.device_bytes(self.model.variables)

    def get_parallelism_info(self):
        """A dict describing how the model is parallelised.

        Returns:
            A dict with `backend`, `world_size`, `tensor_parallel`,
            `data_parallel`, `pipeline_parallel`, `zero_stage`,
            `sequence_parallel`, `config` (the `ParallelConfig` in one
            line), `devices`, `parameter_bytes_per_device` (measured from
            the arrays), `parameter_bytes_total` (unsplit),
            `sharded_layers` and `replicated_layers` (path: reason),
            `vocab_parallel_head` (the LM head whose logits stay split in
            training, or `None`; see `keras_tp.vocab_parallel`).
        """
        info = reporting.parallelism_info(self._runtime, self.model, self._plan)
        head = self._vocab_head
        return {**info, "vocab_parallel_head": head and head.layer.path}

    def summary(self, print_fn=None, **kwargs):
        """Prints the plan: per layer, style, local shape and bytes/device.

        A pipelined model prints its stages instead: their layers,
        parameters and the tensors that cross each cut. Then the bytes of
        the parameters, and the `ParallelConfig`.

        Args:
            print_fn: function taking a line of text; defaults to Keras'
                `print_msg`.
        """
        lines = reporting.summary_lines(self._runtime, self.model, self._plan)
        for text in lines:
            (print_fn or print_msg)(text)

    def get_weights(self):
        """The original model's weights, unsplit, as NumPy arrays."""
        attach_trainer_state(self)
        return [self._runtime.full_value(v) for v in self.model.weights]

    def set_weights(self, weights):
        """Sets the original model's weights from unsplit arrays.

        Args:
            weights: arrays in the order and full shapes of `get_weights()`.
        """
        weight_files.set_full_weights(self._runtime, self.model, weights)

    def save(self, filepath, overwrite=True, **kwargs):
        """Saves the original, unsplit model with the current weights."""
        self._runtime.save_model(
            self.model, filepath, overwrite=overwrite, **kwargs
        )

    def save_weights(self, filepath, overwrite=True):
        """Saves a sharded checkpoint of the weights and optimizer state.

        `filepath` becomes a checkpoint directory, whatever its name ends
        with: Keras' `BackupAndRestore` and `ModelCheckpoint` callbacks
        name it `*.weights.h5`. Every process writes its own pieces (see
        `keras_tp.save_checkpoint`); `load_weights` resumes from it at any
        layout. For one Keras file of the unsplit model, use `save()`.

        Args:
            filepath: the checkpoint directory.
            overwrite: whether to replace a checkpoint already there.

        Example:

        ```python
        backup = keras.callbacks.BackupAndRestore("backup")
        tp.fit(x, y, epochs=4, callbacks=[backup])
        ```
        """
        weight_files.save_weights(self, filepath, overwrite)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a checkpoint written by `save_weights` or `save_checkpoint`.

        The weights and, for a compiled model, the optimizer state and step
        are restored at this model's layout, whatever the saving layout or
        backend was.

        Args:
            filepath: the checkpoint directory.
            skip_mismatch: not supported: a checkpoint of another
                architecture is refused, naming the variable.
        """
        weight_files.load_weights(self, filepath, skip_mismatch, kwargs)

    def save_checkpoint(self, directory, epoch=None):
        """Saves a sharded checkpoint: see `keras_tp.save_checkpoint`."""
        return checkpoint.save_checkpoint(self, directory, epoch=epoch)

    def load_checkpoint(self, directory):
        """Loads a checkpoint at this layout: see `keras_tp.load_checkpoint`."""
        return checkpoint.load_checkpoint(self, directory)

    def get_config(self):
        raise NotImplementedError(
            "TensorParallelKeras is not serialised itself: `save()` writes "
            "the original model, which you wrap again after loading."
        )
