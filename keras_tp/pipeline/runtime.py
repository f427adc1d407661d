"""`PipelineRuntime`: what every backend's pipeline
(`keras_tp.runtime.<backend>.pipeline`) shares."""

import collections
import warnings

import keras
import numpy as np
from keras import ops

from keras_tp.keras_internals import compiled_loss
from keras_tp.keras_internals import sublayers
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.parallel.batch_loss import MEAN_REDUCTIONS
from keras_tp.parallel.batch_loss import adds_losses
from keras_tp.parallel.batch_loss import averages_over_rows
from keras_tp.parallel.batch_loss import kept_fraction
from keras_tp.parallel.batch_loss import warn_of_added_losses
from keras_tp.pipeline import schedules
from keras_tp.pipeline.cutting import split_stages
from keras_tp.placement import Placement
from keras_tp.runtime.base import Runtime
from keras_tp.stats import CommunicationStats
from keras_tp.tensors import carried_masks

# Targets and their sample weights, split into micro-batches together.
WeightedTargets = collections.namedtuple("WeightedTargets", "y weights")


def weighted(targets):
    """`(y, sample_weight)` of `unpacked`'s targets (weights maybe `None`)."""
    if isinstance(targets, WeightedTargets):
        return targets.y, targets.weights
    return targets, None


class PipelineRuntime(Runtime):
    """A `Runtime` on a `data x pipe x model` grid of devices: each stage
    runs on a `MeshRuntime` of its `data x model` devices, which stores
    the variables its stage owns and runs its split layers; Keras' steps
    run as a schedule of micro-batches (`keras_tp.pipeline.executor`)."""

    whole_logits_reason = (
        "a pipeline's last stage computes the loss from whole logits"
    )
    local_ranks = False
    # Python issues each stage's work: the step is not one program.
    jit_compile_default = False
    # A function returning the index of the stage whose work is issued
    # now (`CallingStageRegions`); `None` where a rank runs one stage.
    calling_stage = None
    # The last training step's `StagePrimitives.order`.
    trained_order = None
    # Each stage's update is the backend's (see `Runtime`).
    coordinating_runtime = None

    def __init__(self, model, config):
        super().__init__(config)
        _check_layers(model)
        self.pipeline_parallel = stages = self.config.pipeline_parallel
        self.num_microbatches = self.config.num_microbatches
        self.schedule = self.config.schedule
        shape = (self.data_parallel, stages, self.tensor_parallel)
        # Stage `s` runs on `pipe` index `s` of the grid.
        grid = np.array(self.devices, dtype=object).reshape(shape)
        self.stage_devices = [list(grid[:, s, :].flat) for s in range(stages)]
        # Stages may share a weight (a tied embedding): each that uses it
        # holds a copy, which the backend keeps equal.
        self.split = split_stages(model, stages, self.config.pipeline_cuts)
        self.stage_models = [stage.model for stage in self.split.stages]
        if self.tensor_parallel > 1:
            # A later stage takes split tensors (a Column layer's output
            # arrives as each rank's shard), which its split layers check.
            for stage_model in self.stage_models[1:]:
                stage_model.input_spec = None
        self.owners = self.split.owners
        self.stage_of = self.owners.stage_of
        self.owners.check_variables()
        # Whether each stage's layers add losses (regularizers, add_loss),
        # which its passes add, per micro-batch, to the compiled loss.
        self.adding_stages = [adds_losses(m) for m in self.stage_models]
        # Whether the loss weighs micro-batches by their masks' fractions.
        outputs = self.stage_models[-1].outputs
        self.masked_predictions = len(outputs) == 1 and bool(
            carried_masks(outputs)
        )
        self.placement = Placement(self.tensor_parallel, 1, self)
        self.stats = CommunicationStats()
        self.device_mesh = keras.distribution.DeviceMesh(
            shape=shape,
            axis_names=("data", "pipe", "model"),
            devices=list(self.devices),
        )
        self.trainer = None

    def stage_runtimes_of(self, runtime_class):
        """A `runtime_class` per stage, on its `data x model` devices."""
        return [
            self.counted(runtime_class(self.config.stage_config(devices)))
            for devices in self.stage_devices
        ]

    def counted(self, runtime):
        """`runtime`, its collectives counted in this pipeline's `stats`."""
        for name in ("adapter", "data_adapter", "world_adapter"):
            getattr(runtime, name).stats = self.stats
        return runtime

    def place_variable(self, variable, axis):
        """Places `variable` on its owner's devices; each later stage that
        uses it (a tied embedding) borrows the split (see `keep_copy`)."""
        owner = self.stage_of[id(variable)]
        # The owner comes first in its stages.
        for stage in self.owners.shared_stages.get(id(variable), ())[1:]:
            self.stage_runtimes[stage].placement.borrow(variable, axis)
            self.keep_copy(variable, axis, stage)
        self.stage_runtimes[owner].placement.place(variable, axis)

    def place_variable_like(self, variable, reference, data_axis):
        """Places an optimizer slot on its reference's stage, with ZeRO
        partitioned over that stage's replicas."""
        stage = self.owners.adopt(variable, reference)
        placement = self.stage_runtimes[stage].placement
        if self.zero_stage:
            data_axis = placement.partition_axis(reference)
        placement.place_like(variable, reference, data_axis)

    def stage_runtime_of(self, variable):
        """The runtime of the stage storing `variable`: its owner's; for
        an optimizer's own variable, the one that placed it, else `None`."""
        stage = self.stage_of.get(id(variable))
        if stage is not None:
            return self.stage_runtimes[stage]
        return next(
            (r for r in self.stage_runtimes if r.placement.is_placed(variable)),
            None,
        )

    def assign_local_pieces(self, variable, read):
        # A later stage's copy of a shared weight follows at the next step;
        # the compiled optimizer's own variables are whole.
        runtime = self.stage_runtime_of(variable)
        if runtime is None:
            variable.assign(read(tuple((0, int(n)) for n in variable.shape)))
        else:
            runtime.assign_local_pieces(variable, read)

    def keep_copy(self, variable, axis, stage):
        """Stores `stage`'s copy of an earlier stage's weight; by default
        none: the stage receives one each step."""

    def prepare_trainer(self, trainer):
        """Keeps the `TensorParallelKeras` whose steps this runtime runs."""
        self.trainer = trainer

    def stage_plans(self, plan):
        """`(part of plan, runtime)` pairs: each stage's split layers with
        its runtime; a layer several stages call (a tied embedding) with
        `CallingStageRegions` where one process runs them all."""
        stages_of = {}
        for index, stage in enumerate(self.stage_models):
            for layer in sublayers(stage):
                stages_of[id(layer)] = stages_of.get(id(layer), ()) + (index,)
        parts = []
        for stages in dict.fromkeys(stages_of.values()):
            part = plan.part_for(
                lambda layer, stages=stages: stages_of[id(layer)] == stages
            )
            if not (part.layers or part.per_rank_random):
                continue
            runtime = self.stage_runtimes[stages[0]]
            if self.calling_stage is not None and len(stages) > 1:
                runtimes = {s: self.stage_runtimes[s] for s in stages}
                runtime = CallingStageRegions(runtimes, self.calling_stage)
            parts.append((part, runtime))
        return parts

    def run_step(self, phase, step, *args, **kwargs):
        """Runs this runtime's `{phase}_step(*args)` instead of Keras'."""
        with self.stats.recording(phase):
            return getattr(self, f"{phase}_step")(*args, **kwargs)

    def measured_timeline(self):
        """The last training step's measured `schedules.Timeline`."""
        if self.trained_order is None:
            return None
        return schedules.timeline_of(self.trained_order, self.action_times())

    def action_times(self):
        """The measured `(start, end)` of each action of `trained_order`."""
        raise NotImplementedError

    def check_compiled(self, trainer):
        """Refuses, when the model is compiled, what a pipeline would
        compute differently from Keras."""
        if trainer.jit_compile is True:
            raise ValueError(
                "pipeline_parallel issues each stage's work from Python, so "
                "the step is not one compiled program: call "
                "`compile(..., jit_compile=False)` (the default)."
            )
        for loss in keras.tree.flatten(trainer.loss):
            name = getattr(loss, "name", getattr(loss, "__name__", loss))
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            if reduction not in MEAN_REDUCTIONS:
                raise ValueError(
                    f"Loss '{name}' has reduction={reduction!r}. A pipeline "
                    "adds up each micro-batch's mean loss, weighted by "
                    "1/num_microbatches, which is the batch's loss only for "
                    "a mean: use reduction='sum_over_batch_size'."
                )
            if loss is not None and not averages_over_rows(loss):
                warnings.warn(
                    f"Loss '{name}' is not one of Keras' own: a pipeline "
                    "averages its micro-batches' losses, not the batch's "
                    "where it pairs samples or divides by counts over it.",
                    stacklevel=3,
                )

    def loss_seed(self):
        """What the backward passes seed the loss's gradient with: the
        compiled optimizer's `scale_loss` of 1 (a loss scale, or a
        `loss_scale_factor` its `apply` divides out)."""
        return self.trainer.optimizer.scale_loss(ops.ones(()))

    def microbatches(self, batch_size):
        """The number of micro-batches for a batch of `batch_size`."""
        if self.num_microbatches is not None:
            schedules.check_microbatches(batch_size, self.num_microbatches)
            return self.num_microbatches
        limit = min(batch_size, 4 * self.pipeline_parallel)
        return max(m for m in range(1, limit + 1) if batch_size % m == 0)

    def loss_function(self, num_microbatches):
        """A micro-batch's share of the batch's compiled loss, from its
        `(targets, y_pred)`, as `(loss, fraction)`: its mean loss over
        `num_microbatches` (equal micro-batches' shares add up to the
        batch's mean). A masked prediction's mean is over unmasked entries,
        times `fraction`, the share its mask keeps (the batch's is the mean
        over the mean fraction, `fraction_scale`); `fraction` is `None`
        without a mask or split."""
        loss = self._compiled_loss()
        split = num_microbatches * self.data_parallel > 1
        if split:
            if self.masked_predictions and any(self.adding_stages):
                raise ValueError(
                    "The predictions carry a Keras mask and the model's "
                    "layers add losses (regularizers, add_loss): a pipeline "
                    "scales its micro-batches' gradients by their shares of "
                    "unmasked entries, known once every micro-batch has run, "
                    "and would scale the added losses' too. Pass "
                    "num_microbatches=1 and data_parallel=1, or use AdamW's "
                    "weight_decay instead of the regularizers."
                )
            warn_of_added_losses(
                self.split.model,
                f"num_microbatches={num_microbatches} and "
                f"data_parallel={self.data_parallel}",
            )

        def microbatch_loss(targets, y_pred):
            y, weights = weighted(targets)
            value = loss(y, y_pred, weights)
            fraction = kept_fraction(y_pred, split)
            if fraction is None or not split:
                return value / num_microbatches, None
            return value * fraction / num_microbatches, fraction

        return microbatch_loss

    def added_total(self, stage, losses):
        """The sum of the `losses` stage `stage`'s layers added in a call,
        each summed as Keras sums it; `None` without any. Each micro-batch
        adds `1 / num_microbatches` of it."""
        if losses and not self.adding_stages[stage]:
            raise ValueError(
                f"Layers of pipeline stage {stage} added "
                f"{len(losses)} loss(es) in a call that keras_tp did not "
                "foresee (an add_loss outside a layer's `call` method): "
                "their gradients would be lost. Call add_loss in the "
                "layer's own `call`."
            )
        if not losses:
            return None
        return sum(ops.sum(ops.cast(loss, "float32")) for loss in losses)

    def _compiled_loss(self):
        loss = compiled_loss(self.trainer)
        if loss is None:
            raise ValueError(
                "A pipelined model trains and evaluates with the loss given "
                "to compile(loss=...); it has none."
            )
        return loss

    def whole_batch_loss(self, targets, y_pred, added=None):
        """The loss of the whole batch's `y_pred`, plus the losses the
        stages' layers `added` (`evaluate()` on JAX and TensorFlow)."""
        model_masks = carried_masks(self.stage_models[-1].outputs)
        if model_masks.keys() - carried_masks(y_pred).keys():
            warnings.warn(
                "The predictions carry a Keras mask, which they lost on "
                "their way out of the pipeline's stages: evaluate() "
                "computes the loss over every entry, masked ones included "
                "(fit() computes it with the mask).",
                stacklevel=3,
            )
        y, weights = weighted(targets)
        loss = self._compiled_loss()(y, y_pred, weights)
        return loss if added is None else loss + added

    def update_metrics(self, x, targets, loss, y_pred):
        """Updates the loss tracker and metrics as Keras' step does;
        returns the logs."""
        batch = keras.tree.flatten(x)[0].shape[0]
        update_loss_tracker(self.trainer, loss, batch)
        y, weights = weighted(targets)
        return self.trainer.compute_metrics(x, y, y_pred, weights)

    @staticmethod
    def unpacked(data):
        """`(x, targets)` of a step's `data`: `y`, with its sample weights
        where given (`WeightedTargets`)."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is None or y is None:
            return x, y
        return x, WeightedTargets(y, sample_weight)

    def call_model(self, model, inputs, training):
        with self.stats.recording("call"):
            return self.split.run(inputs, training=training)


class CallingStageRegions:
    """Runs the split layers that several stages call (a tied embedding)
    on the calling stage's devices with its copy of the weights: what a
    region reads of its runtime, at each call, its `adapter` too, is the
    calling stage's; the owner's (first in `runtimes`) where `calling()`
    is `None` (Keras' symbolic build, a direct call)."""

    def __init__(self, runtimes, calling):
        self.runtimes = runtimes
        self._owner = next(iter(runtimes.values()))
        self._stage = calling

    def calling_runtime(self):
        """The runtime of the stage whose work is issued now."""
        return self.runtimes.get(self._stage(), self._owner)

    def prepare_local_layer(self, layer):
        for runtime in self.runtimes.values():
            runtime.prepare_local_layer(layer)

    def prepare_region(self, region):
        for runtime in self.runtimes.values():
            runtime.prepare_region(region)

    def __getattr__(self, name):
        return getattr(self.calling_runtime(), name)


def _check_layers(model):
    """Refuses layers whose training a pipeline would change."""
    for layer in sublayers(model):
        batch_norm = isinstance(layer, keras.layers.BatchNormalization)
        if batch_norm and layer.trainable:
            raise ValueError(
                f"Layer '{layer.name}' is a trainable BatchNormalization: "
                "with pipeline_parallel each micro-batch would be "
                "normalised by its own statistics, not the batch's. Freeze "
                "it (`layer.trainable = False` uses the moving statistics) "
                "or use LayerNormalization or GroupNormalization."
            )
