"""The nodes of a Functional model's graph (`keras_tp.pipeline.graph`)."""

from keras import ops
from keras import tree

from keras_tp.keras_internals.layers import sublayers


def producer_node(tensor):
    """`(node, tensor_index)` of the call that produced `tensor`, or `None`.

    `None` for a tensor with no recorded history (a constant).
    """
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    node = history.operation._inbound_nodes[history.node_index]
    return node, history.tensor_index


def layer_call_nodes(layer):
    """The nodes of every call of `layer` in the graphs it was built in."""
    return list(layer._inbound_nodes)


def node_operation(node):
    """The operation (layer or raw op) a node calls."""
    return node.operation


def node_inputs(node):
    """The `KerasTensor`s among a node's call arguments, flattened."""
    return list(node.arguments.keras_tensors)


def node_outputs(node):
    """The `KerasTensor`s a node returned, flattened."""
    return list(node.outputs)


def is_input_node(node):
    """Whether a node is the call of an `InputLayer` (a graph input)."""
    return node.is_input


def node_call_arguments(node):
    """`(args, kwargs)` a node was called with, tensors included."""
    return node.arguments.args, node.arguments.kwargs


def node_filled_arguments(node, values):
    """`(args, kwargs)` of a node with its tensors replaced.

    Args:
        node: the node.
        values: `{id(keras_tensor): value}` for each of the node's input
            tensors.
    """
    return node.arguments.fill_in(values)


def graph_constants(model):
    """`[(operation name, tensor)]`: the concrete tensors that the nodes of
    the Functional graphs of `model` and of its nested models hold as call
    arguments, passed again at every call (a tensor the model's
    constructor computed from a weight)."""
    constants = []
    for layer in [model, *sublayers(model)]:
        for operation in getattr(layer, "_operations", ()):
            for node in operation._inbound_nodes:
                arguments = (node.arguments.args, node.arguments.kwargs)
                constants += [
                    (operation.name, leaf)
                    for leaf in tree.flatten(arguments)
                    if ops.is_tensor(leaf)
                ]
    return constants
