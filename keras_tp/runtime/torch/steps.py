"""How Keras' torch steps run on a rank.

Without a data axis Keras' own torch trainer runs unchanged in each
process. With one, each data rank runs Keras' step on its slice of the
global batch, and the ranks then agree on the metrics and the
non-trainable state, so the logs are the global batch's. A step keeps its
saved tensors detached (`saved_tensors`); with overlap, the gradient
buckets start their all-reduce during the backward pass.
"""

import contextlib

import keras
import numpy as np
import torch

from keras_tp.keras_internals import map_added_losses
from keras_tp.keras_internals import tracked_loss
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.parallel.overlap import BackwardOverlap
from keras_tp.plan.split_logits import whole_logits
from keras_tp.runtime import padding
from keras_tp.runtime.torch.saved_tensors import DetachedSavedTensors
from keras_tp.runtime.torch.storage import parameter_of


class ProcessSteps:
    """The `TorchRuntime`'s steps and direct calls (see the module)."""

    def run_step(self, phase, step, *args, **kwargs):
        """Runs Keras' step; with a data axis, on this rank's batch slice.

        Each data rank trains on its slice of the global batch: the batch
        the step gets, where it is this row's share (`batches_are_shares`),
        else the slice it cuts from the global batch. Its metric
        updates are summed over `data` and its float non-trainable state
        averaged (one all-reduce), so the logs are the global batch's; the
        predictions of the slices are gathered into the global batch's.
        `predict` and `evaluate` pad a batch that does not split
        (`keras_tp.runtime.padding`).
        """
        if not self.per_rank_steps:
            with self.step_context():
                return super().run_step(phase, step, *args, **kwargs)
        (data,) = args
        model = step.__self__
        shares = self.batches_are_shares
        extra = 0 if shares else padding.rows_to_add(data, self.data_parallel)
        with self.adapter.stats.recording(phase), self.step_context():
            if phase == "test" and extra:
                with whole_logits():
                    return self._padded_test_step(model, data, extra)
            size = padding.batch_size(data)
            if phase == "predict" and extra:
                data = padding.padded(data, extra)
            if not shares:
                data = keras.tree.map_structure(self.batch_slice, data)
            if phase == "predict":
                outputs = self.gathered(step(data))
                return outputs if shares else padding.dropped(outputs, size)
            metrics = model.metrics_variables
            before = [v.value.detach().clone() for v in metrics]
            if phase == "train":
                self._start_backward_overlap(model)
            step(data)
            self.synchronise_step_state(
                metrics, before, model.non_trainable_variables
            )
            return model.get_metrics_result()

    def synchronise_step_state(self, metrics, before, non_trainable=()):
        """Assigns the global batch's `metrics` from this rank's (their
        values `before` its step) and the data-averaged `non_trainable`
        (`synchronised_state`)."""
        non_trainable = list(non_trainable)
        new_metrics, values = self.synchronised_state(
            non_trainable,
            [v.value.detach() for v in non_trainable],
            before,
            [v.value.detach() for v in metrics],
        )
        for variable, value in zip(
            metrics + non_trainable, new_metrics + values
        ):
            variable.assign(value)

    def gathered(self, outputs):
        """The global batch's outputs from every data rank's."""
        return keras.tree.map_structure(
            lambda y: (
                self.data_adapter.all_gather(y, 0) if torch.is_tensor(y) else y
            ),
            outputs,
        )

    def _padded_test_step(self, model, data, extra):
        """Keras' test step on a batch that needed `extra` rows to split.

        Each data rank runs the model on its slice of the padded batch;
        the loss and the metrics are computed on every rank alike, on the
        real rows of the global batch's outputs (see
        `keras_tp.runtime.padding`), so no metric counts a padded row.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        size = padding.batch_size(x)
        x_slice = keras.tree.map_structure(
            self.batch_slice, padding.padded(x, extra)
        )
        y_pred = padding.dropped(
            self.gathered(model(x_slice, training=False)), size
        )
        tracked_loss(model, x, y, y_pred, sample_weight, False, size)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def run_on_ranks(self, fn, variables, phase):
        """Runs `fn()` in this rank's process, without autograd, as Keras'
        torch trainer runs the optimizer."""
        with torch.no_grad():
            super().run_on_ranks(fn, variables, phase)

    def _start_backward_overlap(self, model):
        """Sends each gradient bucket as soon as the backward pass made it.

        Each trainable parameter gets a post-accumulate-grad hook (once,
        when the optimizer is built) that hands its gradient to the
        optimizer's `BackwardOverlap`; a bucket complete starts its
        all-reduce asynchronously, while the backward pass goes on.
        """
        optimizer = getattr(model, "optimizer", None)
        if not (
            isinstance(optimizer, CoordinatedOptimizer)
            and optimizer.built
            and optimizer.overlaps
        ):
            return
        if optimizer.backward_overlap is None:
            variables = list(model.trainable_variables)
            overlap = BackwardOverlap(
                optimizer.buckets, variables, self.data_adapter
            )
            for index, variable in enumerate(variables):
                parameter_of(variable).register_post_accumulate_grad_hook(
                    lambda parameter, index=index: overlap.gradient_ready(
                        index, parameter.grad
                    )
                )
            optimizer.backward_overlap = overlap
        optimizer.backward_overlap.start_step()

    def data_row(self):
        if self.data_parallel == 1:
            return None
        return self.data_adapter.rank(), self.data_parallel

    def batch_slice(self, tensor):
        """This data rank's slice of a global batch tensor."""
        if isinstance(tensor, np.ndarray):
            # `train_on_batch` and the like hand NumPy batches over as
            # they are; `fit()` hands tensors.
            tensor = keras.ops.convert_to_tensor(tensor)
        if not torch.is_tensor(tensor) or tensor.ndim == 0:
            return tensor
        self.check_batch_size(tensor.shape[0])
        size = tensor.shape[0] // self.data_parallel
        return tensor.narrow(0, self.data_adapter.rank() * size, size)

    def call_model(self, model, inputs, training):
        if self._sequence is None:
            return super().call_model(model, inputs, training)
        with self._sequence.step():
            outputs = super().call_model(model, inputs, training)
            self.whole_losses(model)
            return self._sequence.whole(outputs)

    def whole_losses(self, model):
        """Makes whole the losses `model`'s layers added in its last call:
        a whole layer computing on shards (a MoE router) adds them as
        `DTensor`s, which Keras' loss adds to its own."""
        if self._sequence is not None:
            map_added_losses(model, self._sequence.whole)

    def whole_outputs(self, outputs):
        """A model's `outputs` with every sequence shard gathered (inside
        `step_context`)."""
        if self._sequence is None:
            return outputs
        return self._sequence.whole(outputs)

    def accumulating_gradients(self):
        """The context of backward passes whose gradients add up before
        an update (a pipeline's micro-batches): under sequence parallelism
        each parameter's partial sums are made whole once, on leaving."""
        if self._sequence is None:
            return contextlib.nullcontext()
        return self._sequence.accumulating()

    def step_context(self):
        """A step keeps its saved tensors detached (see `saved_tensors`);
        under sequence parallelism, in the shards' context, which does
        too."""
        if self._sequence is None:
            return DetachedSavedTensors()
        return self._sequence.step()
