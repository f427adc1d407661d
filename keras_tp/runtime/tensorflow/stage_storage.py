"""Where a TensorFlow pipeline's variables live: on their owning stage's
replicas, and a shared weight's copy on each later stage that uses it,
refreshed once a step."""

import contextlib

import tensorflow as tf

from keras_tp.checkpoint.state import one_device_keys
from keras_tp.checkpoint.state import stage_slots
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.runtime.tensorflow.devices import device_name
from keras_tp.tensors import nbytes


class StageStorage:
    """Pipeline runtime mixin: the storage the module docstring tells."""

    def keep_copy(self, variable, axis, stage):
        copy = self.stage_runtimes[stage].storage_copy(variable, axis)
        self._copies[stage, id(variable)] = (variable, copy)

    @contextlib.contextmanager
    def reading_copies(self, stage):
        """Makes `stage`'s replica steps read its copies of shared weights."""
        swapped = [
            (variable, stored_value(variable))
            for variable in self.stage_models[stage].weights
            if (stage, id(variable)) in self._copies
        ]
        for variable, _ in swapped:
            set_stored_value(variable, self._copies[stage, id(variable)][1])
        try:
            yield
        finally:
            for variable, owned in swapped:
                set_stored_value(variable, owned)

    def refresh_copies(self):
        """Copies each shared weight's pieces from its owner's replicas to
        the later stages' copies, replica `(d, t)` to `(d, t)`."""
        for (stage, _), (variable, copy) in self._copies.items():
            owned = stored_value(variable).values
            runtime = self.stage_runtimes[stage]

            def refresh(copy=copy, owned=owned, runtime=runtime):
                copy.assign(owned[runtime.replica_id()].read_value())
                # `strategy.run` needs a result to return.
                return tf.zeros(())

            runtime.replica_results(refresh, self.stage_models[stage])
            for piece in owned:
                self.stats.record("send", nbytes(piece), "forward", "pipe")

    def full_value(self, variable):
        return self.stage_runtime_of(variable).full_value(variable)

    def assign_full_value(self, variable, value):
        self.stage_runtime_of(variable).assign_full_value(variable, value)

    def local_pieces(self, variable):
        # In files named by stage and replica; the compiled optimizer's own
        # variables, unplaced, with the first stage's first replica's.
        runtime = self.stage_runtime_of(variable) or self.stage_runtimes[0]
        stage = self.stage_runtimes.index(runtime)
        return [
            (f"stage{stage}-{writer}", index, array)
            for writer, index, array in runtime.local_pieces(variable)
        ]

    def save_model(self, model, filepath, **kwargs):
        # Each stage's variables assembled.
        with contextlib.ExitStack() as assembled:
            for stage, runtime in enumerate(self.stage_runtimes):
                owned = [
                    v
                    for v in model.variables
                    if self.stage_of.get(id(v)) == stage
                ]
                assembled.enter_context(runtime.assembled(owned))
            model.save(filepath, **kwargs)

    def checkpoint_optimizer_state(self, optimizer):
        """`[(key, variable)]` of the optimizer state, keyed as one
        device's: the compiled optimizer's own, then each trainable
        variable's slots (its owner's)."""
        self.build_optimizer(self.trainer)
        slots = {}
        for stage, runtime in zip(self.stage_optimizers, self.stage_runtimes):
            inner = stage.inner_optimizer
            slots.update(stage_slots(inner, runtime.placement.references))
        trainable = self.trainer.trainable_variables
        return one_device_keys(trainable, optimizer.variables, slots)

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables and their copies."""
        totals = dict.fromkeys(self.devices, 0)
        for stage, runtime in enumerate(self.stage_runtimes):
            placed = [
                v
                for v in variables
                if runtime.placement.is_placed(v)
                and self.stage_of.get(id(v), stage) == stage
            ]
            for device, size in runtime.device_bytes(placed).items():
                totals[device] = totals.get(device, 0) + size
        wanted = {id(v) for v in variables}
        for (_, key), (_, copy) in self._copies.items():
            for piece in copy.values if key in wanted else ():
                totals[device_name(piece.device)] += nbytes(piece)
        return totals
