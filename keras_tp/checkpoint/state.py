"""What a checkpoint holds, under names that do not depend on the layout.

Variables are keyed by their position: `model/i` is the i-th of the
model's `variables`, `optimizer/i` the i-th of the optimizer's (the inner
optimizer's for a `CoordinatedOptimizer`, whose own variables are
`coordinated/i`). Two builds of one architecture list their variables in
the same order on every backend, at every layout, even where Keras gave
their layers other automatic names; the manifest keeps the paths for
error messages.
"""

import itertools

import keras
import numpy as np

from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.parallel.loss_scaling import unscaled


def checkpoint_state(model, build_optimizer=False):
    """`[(key, variable)]` of everything a checkpoint of `model` holds.

    Args:
        model: a `TensorParallelKeras` or a plain `keras.Model`.
        build_optimizer: build a compiled optimizer that has no state yet,
            so that state can be loaded into it.
    """
    runtime = _runtime_of(model)
    inner = model if runtime is None else model.model
    state = [(f"model/{i}", v) for i, v in enumerate(inner.variables)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return state
    if not optimizer.built:
        if not build_optimizer:
            return state
        storage_of(model).build_optimizer(model)
    # A loss scale's variables are its own, whichever optimizer it wraps.
    scaled, optimizer = optimizer, unscaled(optimizer)
    scales = _own_variables(scaled, optimizer)
    state += [(f"loss_scale/{i}", v) for i, v in enumerate(scales)]
    if runtime is not None:
        held = runtime.checkpoint_optimizer_state(optimizer)
        if held is not None:
            return state + held
    inner = optimizer
    if isinstance(optimizer, CoordinatedOptimizer):
        inner = optimizer.inner_optimizer
    state += [(f"optimizer/{i}", v) for i, v in enumerate(inner.variables)]
    own = _own_variables(optimizer, inner)
    return state + [(f"coordinated/{i}", v) for i, v in enumerate(own)]


def _own_variables(wrapper, inner):
    """The variables of optimizer `wrapper` that `inner` does not hold."""
    held = {id(v) for v in inner.variables}
    return [v for v in wrapper.variables if id(v) not in held]


def stage_slots(optimizer, references):
    """Each variable's slots in a stage's own `optimizer` (a pipeline
    stage's), by the id of the variable, in the order the optimizer made
    them.

    Args:
        optimizer: a Keras optimizer built on the variables of a stage.
        references: the stage's `Placement.references`.

    Raises:
        ValueError: unless the optimizer made each variable's slots one
            after the other, as Keras' optimizers do: a checkpoint keys
            them in that order (`one_device_keys`).
    """
    slots, order = {}, []
    for variable in optimizer.variables:
        reference = references.get(id(variable))
        if reference is not None:
            slots.setdefault(id(reference), []).append(variable)
            order.append(id(reference))
    runs = [key for key, _ in itertools.groupby(order)]
    if len(runs) != len(set(runs)):
        raise ValueError(
            f"Optimizer '{optimizer.name}' does not make each variable's "
            "slots one after the other, so a sharded checkpoint of a "
            "pipeline whose stages hold optimizers of their own cannot key "
            "them as one device's optimizer does. Use save() to write the "
            "unsplit model, or an optimizer of Keras."
        )
    return slots


def one_device_keys(trainable_variables, own, slots, slot_counts=None):
    """`[(key, variable)]` of optimizer state held in stages' optimizers,
    keyed `optimizer/i` as one device's optimizer built on
    `trainable_variables` keys it: its own variables (step count, learning
    rate) first, then each variable's slots, one variable after the other.

    Args:
        trainable_variables: the model's, in order.
        own: the optimizer's own variables, in order.
        slots: by variable id, the slots held here (`stage_slots`).
        slot_counts: by position in `trainable_variables`, how many slots
            each variable has, wherever they are held; `None`: all are
            held here.
    """
    state = [(f"optimizer/{i}", v) for i, v in enumerate(own)]
    index = len(own)
    for position, variable in enumerate(trainable_variables):
        held = slots.get(id(variable), [])
        state += [(f"optimizer/{index + i}", s) for i, s in enumerate(held)]
        counts = slot_counts
        index += len(held) if counts is None else counts.get(position, 0)
    return state


def storage_of(model):
    """Where `model`'s pieces live: its runtime, or the one device."""
    if _runtime_of(model) is None:
        return _OneDeviceStorage(model)
    return _ParallelStorage(model)


def _runtime_of(model):
    """The runtime of a `TensorParallelKeras`; `None` for a Keras model.

    Read as an attribute rather than by the model's class, so that the
    model, which saves through this package, is the only one of the two
    that imports the other.
    """
    return getattr(model, "_runtime", None)


class _ParallelStorage:
    """A `TensorParallelKeras`'s runtime, as the checkpoint code needs it."""

    def __init__(self, model):
        self.model = model
        self.runtime = _runtime_of(model)
        self.local_pieces = self.runtime.local_pieces
        self.assign_local_pieces = self.runtime.assign_local_pieces
        self.full_shape = self.runtime.full_shape
        self.is_first_process = self.runtime.is_first_process
        self.wait_for_processes = self.runtime.wait_for_processes
        self.gather_objects = self.runtime.gather_objects
        self.process_index = self.runtime.process_index

    def build_optimizer(self, model):
        self.runtime.build_optimizer(model)

    def mesh_description(self):
        runtime = self.runtime
        return {
            "world_size": runtime.world_size,
            "tensor_parallel": runtime.tensor_parallel,
            "data_parallel": runtime.data_parallel,
            "zero_stage": runtime.zero_stage,
            "pipeline_parallel": getattr(runtime, "pipeline_parallel", 1),
            "devices": list(runtime.devices),
        }

    def plan_description(self):
        plan = self.model.sharding_plan
        return {
            path: repr(style) for path, (_, style) in _leaf_styles(plan).items()
        }


class _OneDeviceStorage:
    """A plain Keras model: every variable whole, on one device."""

    def __init__(self, model):
        self.model = model

    def local_pieces(self, variable):
        value = keras.ops.convert_to_numpy(variable.value)
        return [("device0", _whole(variable), np.asarray(value))]

    def assign_local_pieces(self, variable, read):
        variable.assign(read(_whole(variable)))

    def full_shape(self, variable):
        return tuple(variable.shape)

    def is_first_process(self):
        return True

    def wait_for_processes(self):
        """One process: nothing to wait for."""

    def gather_objects(self, value):
        return [value]

    def process_index(self):
        return 0

    def build_optimizer(self, model):
        model.optimizer.build(model.trainable_variables)

    def mesh_description(self):
        return {
            "world_size": 1,
            "tensor_parallel": 1,
            "data_parallel": 1,
            "zero_stage": 0,
            "pipeline_parallel": 1,
            "devices": ["device0"],
        }

    def plan_description(self):
        return {}


def _whole(variable):
    return tuple((0, int(size)) for size in variable.shape)


def _leaf_styles(plan):
    return {e.layer.path: (e, e.style) for e in plan.leaf_layers()}
