"""Sequence parallelism on torch: the code between regions on `DTensor`s.

Each rank is a process that runs the model's whole code on its own
tensors. Under sequence parallelism the activations between the regions
are sequence shards, but that code reads shapes from them: keras-hub's
decoders build their causal masks from the hidden states' length, and a
position embedding takes as many rows. So a shard travels as a
`torch.distributed.tensor.DTensor` split on the sequence axis over the
`model` ranks: its shape is the whole sequence's, each rank stores and
computes its shard, and the pointwise code (norms, dropouts, residual
adds) runs on the shard alone. Tensors the code makes from shapes (a
causal mask, a slice of a position table, a dropout's mask) are plain and
whole, and `implicit_replication` lets them meet the shards, as a
replicated `DTensor` would.

- A region's `reduce_from_parallel` reduce-scatters its output into such
  a shard (`TorchCollectiveAdapter.reduce_scatter_sequence`).
- A shard entering a region is all-gathered (`gather_sequence`), once per
  forward pass however many of the region's layers read it. The region's
  matmuls keep only the shard for their backward pass, which gathers it
  again, once (`_RegatheredInputs`), as Megatron does.
- A model output that is a shard is all-gathered whole; its gradient, the
  same on every rank, is sliced back.
- A layer called on a shard reads its own whole weights as replicated
  `DTensor`s, and a weight a region adds to a shard (a Row layer's bias)
  meets it as one, so that their gradients, partial sums over each rank's
  shard, are made whole by one counted collective each in the backward
  pass (Megatron all-reduces its sequence-parallel weights' gradients).

A shard meets mostly pointwise code and whole tensors between the
regions. An operation that mixes the sequence's positions there (a
pooling over it, the attention of a layer the plan keeps whole) makes
DTensor move what it needs itself, as XLA does on JAX; those collectives
are counted too.
"""

import contextlib
import weakref

import keras
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.modules.module import register_module_forward_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from keras_tp.collectives.sequence import SEQUENCE_AXIS
from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import own_trainable_variables
from keras_tp.runtime.torch.saved_tensors import DetachedSavedTensors


class SequenceShards:
    """The sequence shards of a torch runtime's `model` ranks.

    Args:
        adapter: the runtime's `model`-axis `TorchCollectiveAdapter`.
        regions: the runtime's installed regions (a list it fills).
        partitioned: ids of the variables ZeRO-3 partitions (a mapping
            the placement fills), which their layers gather for a call
            (`replicated_if_on_shards`).
    """

    def __init__(self, adapter, regions, partitioned=()):
        self.adapter = adapter
        self.regions = regions
        self.partitioned = partitioned
        self._in_step = False
        self._weights = None
        self._regathered = _RegatheredInputs(adapter)
        # The parameters `make_gradients_whole` watches.
        self._parameters = []
        self._accumulating = False

    @contextlib.contextmanager
    def step(self):
        """The context of a step or a call, its backward pass included:
        whole tensors meet the shards as replicated ones, and a layer
        called on a shard reads its whole weights as replicated.

        The collectives DTensor issues itself are counted (see
        `_CountedDTensorCollectives`).
        """
        if self._in_step:
            # `implicit_replication` switches off on exit, not back to
            # what it was: only the outermost context may enter it.
            yield
            return
        self._in_step = True
        held = {
            id(variable)
            for region in self.regions
            for variable, _ in region.variables()
        }
        held.update(self.partitioned)
        self._weights = _ReplicatedWeights(self.adapter, held)
        try:
            with (
                implicit_replication(),
                self._weights,
                _CountedDTensorCollectives(self.adapter),
                self._regathered,
            ):
                yield
        except (NotImplementedError, RuntimeError) as error:
            if not _is_dtensor_limit(error):
                raise
            raise ValueError(
                "sequence_parallel=True runs the code between the split "
                "layers on sequence shards (torch DTensors), and an "
                "operation there has no rule for them in torch "
                f"({_first_line(error)}). It is most likely the attention "
                "of a layer the plan keeps whole (see "
                "`tp.sharding_plan.fallbacks`). Pass sequence_parallel="
                "False, or use the JAX backend, whose compiler splits any "
                "operation."
            ) from error
        finally:
            self._in_step = False
            self._weights = None

    @property
    def saved(self):
        """A step's saved tensors hooks (a gathered shard regathered),
        which a region's own hooks pass what they do not keep."""
        return self._regathered

    def replicated_if_on_shards(self, values):
        """`values`, whole weights the layer being called reads (its ZeRO-3
        partitions, gathered), as replicated `DTensor`s where it is called
        on a shard, as its other weights are (`_ReplicatedWeights`)."""
        if self._weights is None or not self._weights.on_shards():
            return values
        return [self.adapter.replicated(value) for value in values]

    def make_gradients_whole(self, parameters):
        """A weight a region adds to a shard (a Row layer's bias after its
        reduce-scatter) meets it as a replicated tensor, and its gradient
        arrives as a `DTensor` of partial sums: each such gradient is made
        whole by one counted all-reduce as soon as it is accumulated, or
        once on leaving `accumulating`."""
        self._parameters = list(parameters)
        for parameter in self._parameters:
            parameter.register_post_accumulate_grad_hook(self._make_whole)

    def _make_whole(self, parameter):
        if not self._accumulating and isinstance(parameter.grad, DTensor):
            parameter.grad = self.adapter.whole_gradient(parameter.grad)

    @contextlib.contextmanager
    def accumulating(self):
        """Inside, the partial sums of several backward passes (a
        pipeline's micro-batches) add up, made whole once on leaving."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
        for parameter in self._parameters:
            self._make_whole(parameter)

    def enter(self, x):
        """A region's replicated input, read by split weights: a shard
        all-gathered (its gradient, each rank's partial sum,
        reduce-scattered), any other through `copy_to_parallel`."""
        if isinstance(x, DTensor) and _is_sequence_shard(x):
            gathered = self.adapter.gather_sequence(x)
            self._regathered.keep_shard(gathered, x)
            return gathered
        return self.adapter.copy_to_parallel(self._local(x))

    def whole(self, structure):
        """`structure` with each `DTensor` made a whole local tensor: a
        shard all-gathered (its gradient, the same on every rank, sliced
        back), a partial sum all-reduced."""
        return keras.tree.map_structure(self._local, structure)

    def _local(self, x):
        if not isinstance(x, DTensor):
            return x
        (placement,) = x.placements
        if type(placement) is Shard:
            return self.adapter.gather_from_parallel(
                x.to_local(), placement.dim
            )
        if placement.is_partial():
            return self.adapter.reduce_from_parallel(x.to_local())
        if placement.is_replicate():
            return x.to_local()
        # A layout DTensor made itself: the tokens of a flattened sequence
        # shard, say, strided over the ranks. Its own all-gather, counted.
        return x.full_tensor()


class _ReplicatedWeights:
    """A layer called on a shard reads its own whole trainable weights as
    replicated `DTensor`s (`TorchCollectiveAdapter.replicated`), whose
    gradients come back whole; a layer called on whole tensors reads them
    as they are.

    Args:
        adapter: the `model`-axis `TorchCollectiveAdapter`.
        held: ids of the variables the regions hold, which they read, and
            of ZeRO-3's partitions, which their layers gather.
    """

    def __init__(self, adapter, held):
        self.adapter = adapter
        self.held = held
        self._bindings = []
        # Per layer being called, innermost last: whether on a shard.
        self._on_shards = []

    def __enter__(self):
        # Global module hooks: every Keras layer's call while inside.
        self._hooks = [
            register_module_forward_pre_hook(self._enter_layer),
            register_module_forward_hook(self._leave_layer),
        ]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        # A call that raised left its binding open.
        self._on_shards.clear()
        while self._bindings:
            binding = self._bindings.pop()
            if binding is not None:
                binding.__exit__(None, None, None)

    def on_shards(self):
        """Whether the layer being called now is called on a shard."""
        return bool(self._on_shards) and self._on_shards[-1]

    def _enter_layer(self, module, args):
        pairs = []
        on_shards = isinstance(module, keras.layers.Layer) and any(
            isinstance(x, DTensor) for x in keras.tree.flatten(args)
        )
        self._on_shards.append(on_shards)
        if on_shards:
            pairs = [
                (variable, self.adapter.replicated(variable.value))
                for variable in own_trainable_variables(module)
                if id(variable) not in self.held
            ]
        binding = bind_values(pairs) if pairs else None
        if binding is not None:
            binding.__enter__()
        self._bindings.append(binding)

    def _leave_layer(self, module, args, output):
        self._on_shards.pop()
        binding = self._bindings.pop()
        if binding is not None:
            binding.__exit__(None, None, None)


class _RegatheredInputs(DetachedSavedTensors):
    """Saves a gathered shard for the backward pass as the shard alone.

    A region's matmuls save their input, the whole sequence gathered from
    the shards, for their weights' gradients: that would keep `N` times
    the shard alive per region from the forward pass to the backward one.
    Saved tensors hooks keep the shard instead and gather it again (one
    counted all-gather in the backward pass), once however many of the
    region's matmuls saved it (Megatron's re-gather of its sequence
    parallel inputs).

    Args:
        adapter: the `model`-axis `TorchCollectiveAdapter`.
    """

    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter
        # id of a gathered tensor -> its `_GatheredShard`
        self._shards = {}

    def __exit__(self, *exc):
        self._shards.clear()
        return super().__exit__(*exc)

    def keep_shard(self, gathered, shard):
        """Notes that `gathered` is `shard` all-gathered on its axis."""
        self._shards[id(gathered)] = _GatheredShard(gathered, shard)

    def pack(self, tensor):
        base = tensor if tensor._base is None else tensor._base
        entry = self._shards.get(id(base))
        if entry is None or entry.gathered() is not base:
            return super().pack(tensor)
        regather = entry.regather(self.adapter)
        return regather, tensor.size(), tensor.stride(), tensor.storage_offset()

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        regather, size, stride, offset = packed
        return regather.value().as_strided(size, stride, offset)


class _GatheredShard:
    """A gathered tensor (weakly) and the shard it was gathered from.

    Its `_Regather` is shared by the tensors saved from it (views
    included) and held by them alone, so that the shard gathered again
    lives while one of them is still to be used.
    """

    def __init__(self, gathered, shard):
        self.gathered = weakref.ref(gathered)
        # Detached, as a saved tensor is (see `DetachedSavedTensors`).
        self.shard = shard.detach()
        self._regather = None

    def regather(self, adapter):
        regather = self._regather and self._regather()
        if regather is None:
            regather = _Regather(adapter, self.shard)
            self._regather = weakref.ref(regather)
        return regather


class _Regather:
    """A shard's all-gather again in the backward pass, made once."""

    def __init__(self, adapter, shard):
        self.adapter = adapter
        self.shard = shard
        self._value = None

    def value(self):
        if self._value is None:
            self._value = self.adapter.regather_sequence(self.shard)
        return self._value


class _CountedDTensorCollectives(TorchDispatchMode):
    """Counts each collective DTensor issues itself (a functional
    collective) on the `model` axis.

    Between the regions a shard meets pointwise code and whole tensors,
    which need none. An operation there that mixes the sequence's
    positions (a pooling over it, the attention of a layer the plan keeps
    whole, the backward pass of a slice of a position table) makes DTensor
    move what it needs, as XLA does on JAX: exact, and counted here.

    Args:
        adapter: the `model`-axis `TorchCollectiveAdapter`.
    """

    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            # Modes run before tensor subclasses: this lets DTensor turn the
            # op into local ops and collectives first, which come back here.
            return NotImplemented
        if func.namespace == "_c10d_functional":
            self.adapter.count_functional(func.name(), args[0])
        return func(*args, **(kwargs or {}))


def _is_dtensor_limit(error):
    """Whether `error` is DTensor's: an op it has no sharding rule for."""
    message = str(error)
    return "DTensor" in message or "sharding strategy" in message


def _first_line(error):
    return str(error).strip().splitlines()[0]


def _is_sequence_shard(x):
    """Whether `x` is split on the sequence axis as a region leaves it."""
    (placement,) = x.placements
    return type(placement) is Shard and placement.dim == SEQUENCE_AXIS
