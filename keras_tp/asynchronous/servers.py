"""What the parameter servers hold, and how they combine gradients.

The model's trainable variables are partitioned over the servers by
bytes, whole variables each (as TensorFlow's parameter servers took
variables round-robin, balanced here by size). Each server applies its
partition's part of every update with its own copy of the compiled Keras
optimizer, so a server's optimizer state is its partition's alone.
"""

import keras
import numpy as np


def partition_variables(variables, servers):
    """Assigns each variable to a server, balancing the bytes per server.

    Args:
        variables: the trainable variables.
        servers: the number of servers.

    Returns:
        A list, one per server, of the indices into `variables` that the
        server holds, in increasing order.

    Raises:
        ValueError: if there are more servers than variables.
    """
    if servers > len(variables):
        raise ValueError(
            f"servers={servers} is more than the model's "
            f"{len(variables)} trainable variables; every server holds "
            f"whole variables. Pass servers={len(variables)} or fewer."
        )
    sizes = [
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables
    ]
    loads = [0] * servers
    held = [[] for _ in range(servers)]
    # Largest first, each to the least loaded server (greedy LPT).
    for index in sorted(range(len(variables)), key=lambda i: -sizes[i]):
        server = loads.index(min(loads))
        held[server].append(index)
        loads[server] += sizes[index]
    return [sorted(indices) for indices in held]


def server_optimizer(optimizer, variables):
    """A copy of the compiled optimizer, built on one server's variables.

    Args:
        optimizer: the optimizer the model was compiled with.
        variables: the variables of the server's partition.

    Returns:
        A built `keras.optimizers.Optimizer` of the same class and config.
    """
    copy = optimizer.__class__.from_config(optimizer.get_config())
    copy.build(variables)
    return copy


def weighted_mean(group):
    """The sample-weighted mean of a group of pushed gradients.

    Args:
        group: `Pushed` entries whose payloads are `(gradients, samples,
            loss)`.

    Returns:
        `(gradients, samples, loss)`: the mean gradients (a list of
        tensors), the samples they came from, and their mean loss. Mean
        losses of slices weighted by their sizes give the loss of the
        union of the slices, as data parallelism's mean does.
    """
    samples = sum(p.payload[1] for p in group)
    if len(group) == 1:
        return group[0].payload
    gradients = [
        keras.ops.divide(
            sum(
                keras.ops.multiply(p.payload[0][i], p.payload[1]) for p in group
            ),
            samples,
        )
        for i in range(len(group[0].payload[0]))
    ]
    loss = sum(p.payload[2] * p.payload[1] for p in group) / samples
    return gradients, samples, loss
