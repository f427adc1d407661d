"""Gradient clipping by norm, with the norms taken across all ranks.

A rank holds slices (tensor-parallel shards, ZeRO partitions) and copies
(replicated variables) of the model's gradients. `clipnorm` and
`global_clipnorm` need the norms of the whole gradients: each rank sums
its squares, weighted so that a piece held by several ranks counts once,
and one all-reduce over the mesh adds them up.
"""

from keras import ops


class NormClipping:
    """`clipnorm` and `global_clipnorm`, taken over from an optimizer.

    Norms need every shard's gradient, so a `CoordinatedOptimizer` clips
    by norm across ranks instead of its inner optimizer, whose bounds it
    takes (and clears).

    Args:
        optimizer: the inner Keras optimizer.
    """

    def __init__(self, optimizer):
        self.clip_norm = optimizer.clipnorm
        self.global_clip_norm = optimizer.global_clipnorm
        optimizer.clipnorm = None
        optimizer.global_clipnorm = None
        self._placement = None
        self._world = None
        self._within_replica = False

    def bind(self, placement, world, within_replica):
        """Attaches the ranks whose gradients make the norms.

        Args:
            placement: the `Placement` of the variables.
            world: the collective adapter over those ranks.
            within_replica: whether each data-parallel replica clips its
                own gradients (local SGD), `world` being its `model` axis.
        """
        self._placement = placement
        self._world = world
        self._within_replica = within_replica

    def __call__(self, grads, variables):
        """`grads` of `variables` clipped (see `clipped`)."""
        return clipped(
            grads,
            variables,
            self._placement,
            self._world,
            self.clip_norm,
            self.global_clip_norm,
            within_replica=self._within_replica,
        )


def clipped(
    grads,
    variables,
    placement,
    world,
    clip_norm,
    global_clip_norm,
    within_replica=False,
):
    """Applies `clipnorm` / `global_clipnorm` with norms across ranks.

    Args:
        grads: this rank's gradients of `variables`.
        variables: the trainable variables.
        placement: the `Placement` of the variables.
        world: the collective adapter over the ranks whose gradients make
            the norm: the whole mesh, or one replica's `model` axis.
        clip_norm: the per-variable norm bound, or `None`.
        global_clip_norm: the bound on the norm of all gradients, or
            `None`.
        within_replica: whether each data-parallel replica clips its own
            gradients (local SGD), `world` being its `model` axis.

    Returns:
        The clipped gradients (`grads` itself when neither bound is set).
    """
    if not (clip_norm or global_clip_norm):
        return grads
    squares = ops.stack(
        [
            ops.multiply(
                ops.sum(ops.square(ops.cast(g, "float32"))),
                _norm_weight(placement, v, g, within_replica),
            )
            for g, v in zip(grads, variables)
        ]
    )
    if global_clip_norm:
        norm = ops.sqrt(world.all_reduce(ops.sum(squares), "sum"))
        scale = global_clip_norm * ops.minimum(
            1.0 / norm, 1.0 / global_clip_norm
        )
        scale = scale + (norm - norm)
        return [ops.multiply(g, ops.cast(scale, g.dtype)) for g in grads]
    norms = ops.sqrt(world.all_reduce(squares, "sum"))
    result = []
    for i, g in enumerate(grads):
        norm = norms[i]
        safe = ops.where(norm > 0, norm, ops.ones_like(norm))
        norm = ops.where(norm > 0, safe, norm)
        scale = clip_norm / ops.maximum(norm, clip_norm)
        result.append(ops.multiply(g, ops.cast(scale, g.dtype)))
    return result


def _norm_weight(placement, variable, grad, within_replica):
    """Share of this rank's copy of a gradient in the global sum.

    A gradient held whole by several ranks (replicated over the model axis,
    or not partitioned over the data axis) is counted once in the sum over
    all ranks; within one replica only the model axis holds copies.
    """
    weight = 1.0
    if placement.split_axis(variable) is None:
        weight /= placement.tensor_parallel
    local = tuple(placement.model_shard_shape(variable))
    if not within_replica and tuple(grad.shape) == local:
        weight /= placement.data_parallel
    return weight
