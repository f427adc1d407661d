"""Where a torch pipeline's variables live: each rank stores its shard of
its stage's variables and slots, the other stages' as meta tensors
(shaped, without memory); the first replica's ranks assemble full values."""

import dataclasses
import gc

import torch
import torch.distributed as dist

from keras_tp.checkpoint.state import one_device_keys
from keras_tp.checkpoint.state import stage_slots
from keras_tp.keras_internals import own_optimizer_variables
from keras_tp.runtime.torch.storage import parameter_of
from keras_tp.runtime.torch.storage import storage_bytes
from keras_tp.runtime.torch.storage import swap_storage
from keras_tp.runtime.torch.storage import to_numpy
from keras_tp.runtime.torch.storage import write_on_rank_zero


class StageStorage:
    """Pipeline runtime mixin: the storage the module docstring tells."""

    def full_shape(self, variable):
        # As this rank's stage placed it (a ZeRO partition's slot).
        if self.stage_runtime.placement.is_placed(variable):
            return self.stage_runtime.full_shape(variable)
        return super().full_shape(variable)

    def local_pieces(self, variable):
        """This rank's pieces of its stage's variables: a shared weight's
        written by its owner, the optimizer's own by the first stage."""
        if isinstance(variable, SlotOfAnotherStage):
            return []
        stage_of = self.stage_of
        references = self.stage_runtime.placement.references
        reference = references.get(id(variable), variable)
        stage = stage_of.get(id(variable), stage_of.get(id(reference), 0))
        if stage != self.stage_index:
            return []
        return self.stage_runtime.local_pieces(variable)

    def assign_local_pieces(self, variable, read):
        # Its stage's, a shared weight's copy, the optimizer's own.
        if isinstance(variable, SlotOfAnotherStage):
            return
        own = id(variable) not in self.stage_of
        if own or self.owners.holds(self.stage_index, variable):
            self.stage_runtime.assign_local_pieces(variable, read)

    def checkpoint_optimizer_state(self, optimizer):
        """With replicas, this rank's `CoordinatedOptimizer`'s state keyed
        as one device's, other stages' slots as `SlotOfAnotherStage`s;
        else `None` (`build_optimizer` keeps one device's order)."""
        if self.optimizer_runtime is None:
            return None
        inner = optimizer.inner_optimizer
        references = self.stage_runtime.placement.references
        slots = stage_slots(inner, references)
        trainable = self.trainer.trainable_variables
        owned = {
            position: [
                (slot.path, tuple(self.full_shape(slot)), slot.dtype)
                for slot in slots[id(variable)]
            ]
            for position, variable in enumerate(trainable)
            if self.stage_of[id(variable)] == self.stage_index
            and id(variable) in slots
        }
        stages = [None] * self.pipeline_parallel
        dist.all_gather_object(stages, owned, group=self.pipe_group)
        described = {p: d for stage in stages for p, d in stage.items()}
        for position, variable in enumerate(trainable):
            if id(variable) not in slots and position in described:
                told = described[position]
                slots[id(variable)] = [SlotOfAnotherStage(*d) for d in told]
        own = [v for v in inner.variables if id(v) not in references]
        counts = {p: len(d) for p, d in described.items()}
        state = one_device_keys(trainable, own, slots, counts)
        wrapper = own_optimizer_variables(optimizer)
        return state + [(f"coordinated/{i}", v) for i, v in enumerate(wrapper)]

    def place_variable(self, variable, axis):
        """Keeps this rank's shard of its stage's variables; the other
        stages' on the meta device."""
        # Frees the dead autograd graphs of the planner's trace faster
        # than the full collection `swap_storage` falls back to.
        gc.collect(1)
        if self.owners.holds(self.stage_index, variable):
            self.stage_runtime.placement.place(variable, axis)
        else:
            _to_meta(variable, self.placement.model_shard_shape(variable))

    def place_variable_like(self, variable, reference, data_axis):
        # Keras makes a slot in its reference's shape, its shard already.
        self.owners.adopt(variable, reference)
        if self.owners.holds(self.stage_index, reference):
            self.stage_runtime.placement.place_like(variable, reference)
        else:
            _to_meta(variable, tuple(variable.shape))

    def full_value(self, variable):
        """The unsplit value, broadcast from `_assembler`."""
        full = self._assembled(variable)
        if full is None:
            full = self._empty_full(variable)
        dist.broadcast(full, src=self._assembler(variable))
        return to_numpy(full)

    def _assembler(self, variable):
        """The rank that assembles `variable`: `(0, its stage, 0)`."""
        return self._rank_of(0, self.stage_of[id(variable)], 0)

    def _assembled(self, variable):
        """The unsplit value on `_assembler`'s stage ranks, else `None`."""
        if self.data_index or self.stage_of[id(variable)] != self.stage_index:
            return None
        value = parameter_of(variable).detach()
        # A copy: the array returned must not change with training.
        return self.stage_runtime.unsplit(variable, value).clone()

    def _empty_full(self, variable):
        shape = self.placement.full_shapes[id(variable)]
        dtype = parameter_of(variable).dtype
        return torch.empty(shape, dtype=dtype, device=self.device)

    def assign_full_value(self, variable, value):
        if self.owners.holds(self.stage_index, variable):
            self.stage_runtime.assign_full_value(variable, value)

    def save_model(self, model, filepath, **kwargs):
        """Rank 0 writes the unsplit model, each variable sent by its
        `_assembler`; every rank raises if it failed."""

        def gathered():
            for variable in model.variables:
                assembler = self._assembler(variable)
                split = self.placement.split_axis(variable) is not None
                if assembler == 0 and not split:  # rank 0 holds it whole
                    continue
                full = self._assembled(variable)
                if assembler != 0:
                    if self.rank == assembler:
                        dist.send(full, dst=0)
                    elif self.rank == 0:
                        full = self._empty_full(variable)
                        dist.recv(full, src=assembler)
                if self.rank == 0:
                    yield variable, full

        write_on_rank_zero(
            self.rank, gathered(), lambda: model.save(filepath, **kwargs)
        )

    def device_bytes(self, variables):
        """`{this rank's device: bytes}` of its tensors but meta ones."""
        own = [v for v in variables if parameter_of(v).device.type != "meta"]
        return {self.devices[self.rank]: storage_bytes(own)}


@dataclasses.dataclass(eq=False)
class SlotOfAnotherStage:
    """An optimizer slot another stage's rank holds, as a checkpoint lists
    it (`shape` unsplit)."""

    path: str
    shape: tuple
    dtype: object


def _to_meta(variable, shape):
    """Makes `variable` a "meta" tensor of `shape`, for symbolic builds."""
    dtype = parameter_of(variable).dtype
    swap_storage(variable, torch.empty(shape, dtype=dtype, device="meta"))
