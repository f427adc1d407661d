"""The dataflow graph of a Functional model, nested models flattened: a
node per call of a layer or raw op (the `x + y` of a residual add), in an
order that runs, with the tensors each reads and writes."""

import collections
import dataclasses

import keras

from keras_tp.keras_internals import is_input_node
from keras_tp.keras_internals import node_call_arguments
from keras_tp.keras_internals import node_filled_arguments
from keras_tp.keras_internals import node_inputs
from keras_tp.keras_internals import node_operation
from keras_tp.keras_internals import node_outputs
from keras_tp.keras_internals import producer_node


@dataclasses.dataclass(eq=False)
class TensorInfo:
    """One tensor of the flattened graph, keyed by `(scope, id(tensor))`:
    named as the graph input or its producing node (with `:i` for the i-th
    of several outputs); it crosses the cuts `first <= k <= last`."""

    tensor: keras.KerasTensor = dataclasses.field(repr=False)
    name: str
    producer: int
    last: int = dataclasses.field(default=-1, repr=False)

    def __post_init__(self):
        self.first = 0 if self.producer is None else self.producer + 1


@dataclasses.dataclass(eq=False)
class NodeInfo:
    """One call of an operation in the flattened graph, named as the
    operation prefixed by its nested models' (`backbone.layer_norm`), with
    `:i` for its i-th call (i >= 2)."""

    index: int
    node: object = dataclasses.field(repr=False)
    name: str
    inputs: list = dataclasses.field(repr=False)
    outputs: list = dataclasses.field(repr=False)

    def __post_init__(self):
        self.operation = node_operation(self.node)

    @property
    def is_layer(self):
        return isinstance(self.operation, keras.layers.Layer)

    def replay(self, values):
        """The flat outputs of the operation called again on `values`, a
        function `key -> value` of its inputs."""
        tensors = node_inputs(self.node)
        filled = {id(t): values(key) for t, key in zip(tensors, self.inputs)}
        args, kwargs = node_filled_arguments(self.node, filled)
        return keras.tree.flatten(self.operation(*args, **kwargs))


class Dataflow:
    """The nodes of a Functional or Sequential model in a topological order,
    a depth-first walk from the outputs visiting a node's arguments in
    order (blocks follow each other as in the code that built the model).
    Nested graph models called once on one structure of tensors are opened
    up; any other stays one node (`opaque` names them)."""

    def __init__(self, model):
        self.model = model
        self.nodes = []
        self.tensors = {}
        self.opaque = []
        # A nested model's inputs stand for the tensors it is called on,
        # its call's outputs for its own (`_resolve` follows them).
        self._aliases = {}
        self._scopes = [""]
        self._calls = collections.Counter()
        inputs, outputs, self.input_structure, self.output_structure = (
            graph_endpoints(model)
        )
        for tensor in inputs:
            info = TensorInfo(tensor, tensor.name, None)
            self.tensors.setdefault((0, id(tensor)), info)
        self.inputs = list(self.tensors)
        self._walk(outputs)
        self.outputs = [self._resolve(0, tensor) for tensor in outputs]
        # A stage's inputs are named after the tensors they receive, which
        # may not share a layer's name (a layer called more than once).
        repeated = {
            node.operation.name
            for node in self.nodes
            if self._calls[id(node.operation)] > 1
        }
        for info in self.tensors.values():
            if info.producer is not None and info.name in repeated:
                info.name += "_output"
        # A tensor crosses cut `k` (nodes `[0, k)` before it) from its
        # making to its last reader, or to the end for a model output.
        for node in self.nodes:
            for key in node.inputs:
                self.tensors[key].last = node.index
        for key in self.outputs:
            self.tensors[key].last = len(self.nodes)

    def crossing(self, k):
        """Keys of the tensors crossing cut `k`, in `tensors` order."""
        return [
            key
            for key, info in self.tensors.items()
            if info.first <= k <= info.last
        ]

    def _resolve(self, scope, tensor):
        key = (scope, id(tensor))
        while key in self._aliases:
            key = self._aliases[key]
        return key

    def _walk(self, outputs):
        # An explicit stack, for deep models: the tensors a node reads are
        # pushed after it, so emitted before it.
        opened = set()
        tasks = [(0, t) for t in reversed(outputs)]
        while tasks:
            scope, item = tasks.pop()
            if not isinstance(item, keras.KerasTensor):
                self._emit(scope, item)
                continue
            if self._resolve(scope, item) in self.tensors:
                continue
            found = producer_node(item)
            if found is None or is_input_node(found[0]):
                raise ValueError(
                    f"Tensor {item.name!r} of model '{self.model.name}' is "
                    "not computed from the model's inputs (a constant, or "
                    "an input of a nested model that is not connected); "
                    "the model cannot be cut into stages."
                )
            node = found[0]
            if (scope, id(node)) in opened:
                continue
            opened.add((scope, id(node)))
            operation = node_operation(node)
            if _opens(operation, node):
                inner = len(self._scopes)
                self._scopes.append(self._scopes[scope] + operation.name + ".")
                args = keras.tree.flatten(node_call_arguments(node)[0][0])
                results = node_outputs(node)
                for inner_t, outer_t in zip(operation.inputs, args):
                    self._aliases[(inner, id(inner_t))] = (scope, id(outer_t))
                for inner_t, outer_t in zip(operation.outputs, results):
                    self._aliases[(scope, id(outer_t))] = (inner, id(inner_t))
                tasks.extend((inner, t) for t in reversed(operation.outputs))
            else:
                if isinstance(operation, keras.Model):
                    self.opaque.append(operation.name)
                tasks.append((scope, node))
            tasks.extend((scope, t) for t in reversed(node_inputs(node)))

    def _emit(self, scope, node):
        operation = node_operation(node)
        qualified = self._scopes[scope] + operation.name
        self._calls[id(operation)] += 1
        calls = self._calls[id(operation)]
        name = qualified if calls == 1 else f"{qualified}:{calls}"
        index = len(self.nodes)
        inputs = [self._resolve(scope, t) for t in node_inputs(node)]
        produced = node_outputs(node)
        outputs = [(scope, id(tensor)) for tensor in produced]
        for i, (key, tensor) in enumerate(zip(outputs, produced)):
            # Else an op that returned a tensor it was given.
            if key not in self.tensors:
                suffix = "" if len(produced) == 1 else f":{i}"
                self.tensors[key] = TensorInfo(tensor, name + suffix, index)
        self.nodes.append(NodeInfo(index, node, name, inputs, outputs))


def graph_endpoints(model):
    """`(flat inputs, flat outputs, input structure, output structure)` of
    a Functional model, or a Sequential one built on an input shape."""
    if isinstance(model, keras.Function):
        inputs, outputs = list(model.inputs), list(model.outputs)
        return inputs, outputs, model.input, model.output
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = list(model.inputs), list(model.outputs)
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs:
            raise ValueError(
                f"Sequential model '{model.name}' has no input shape, so "
                "its graph does not exist yet. Start it with "
                "`keras.Input(shape)` or call `model.build(input_shape)` "
                "before splitting it into stages."
            )
        return inputs, outputs, inputs[0], outputs[0]
    raise NotImplementedError(
        f"Model '{model.name}' is a subclassed model "
        f"({type(model).__name__}): its `call` is Python code whose "
        "dataflow Keras does not record, so it cannot be cut into pipeline "
        "stages. Build it with the Functional API "
        "(`keras.Model(inputs, outputs)`) or as a `keras.Sequential`, or "
        "split a Functional part of it (such as its backbone)."
    )


def _opens(operation, node):
    """Whether a node's call of a nested Functional or Sequential model is
    opened up: one positional argument like its inputs, no tensor in
    keyword arguments."""
    if not isinstance(operation, (keras.Function, keras.Sequential)):
        return False
    try:
        inputs, outputs, _, _ = graph_endpoints(operation)
    except (ValueError, NotImplementedError):
        return False
    args, kwargs = node_call_arguments(node)
    if len(args) != 1 or len(outputs) != len(node_outputs(node)):
        return False
    flat = keras.tree.flatten(args[0])
    flat_kwargs = keras.tree.flatten(kwargs)
    if (
        len(flat) != len(inputs)
        or not all(isinstance(t, keras.KerasTensor) for t in flat)
        or any(isinstance(t, keras.KerasTensor) for t in flat_kwargs)
    ):
        return False
    if isinstance(operation, keras.Function) and not (
        len(inputs) == 1 and isinstance(args[0], keras.KerasTensor)
    ):
        try:
            keras.tree.assert_same_structure(
                keras.tree.lists_to_tuples(args[0]),
                keras.tree.lists_to_tuples(operation.input),
            )
        except (ValueError, TypeError):
            return False
    return True
