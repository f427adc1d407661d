"""Gradient clipping by norm, with the norms taken across all ranks.

A rank holds slices (tensor-parallel shards, ZeRO partitions) and copies
(replicated variables) of the model's gradients. `clipnorm` and
`global_clipnorm` need the norms of the whole gradients: each rank sums
its squares, weighted so that a piece held by several ranks counts once,
and one all-reduce over the mesh adds them up.
"""

import contextlib

from keras import ops

from keras_tp.parallel.loss_scaling import loss_scale
from keras_tp.parallel.loss_scaling import unscaled
from keras_tp.tensors import scaled


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
        self.global_clipnorm = optimizer.global_clipnorm
        optimizer.clipnorm = None
        optimizer.global_clipnorm = None
        self._placement = None
        self._world = None
        self._global_world = None
        self._copies = frozenset()
        self._within_replica = False

    def bind(
        self, placement, world, within_replica, global_world=None, copies=()
    ):
        """Attaches the ranks whose gradients make the norms.

        Args:
            placement: the `Placement` of the variables.
            world: the collective adapter over those ranks.
            within_replica: whether each data-parallel replica clips its
                own gradients (local SGD), `world` being its `model` axis.
            global_world: the adapter over the ranks whose gradients make
                the global norm, where more than `world`'s (every stage
                of a pipeline); by default `world`.
            copies: the ids of the variables whose gradients other ranks
                of `global_world` count (a later stage's copy of a tied
                embedding): they count for nothing here.
        """
        self._placement = placement
        self._world = world
        self._global_world = global_world or world
        self._copies = frozenset(copies)
        self._within_replica = within_replica

    def squared_norm(self, grads, variables):
        """The squared norm of the whole gradients of which `grads` are
        this rank's pieces, summed over `world`: one pipeline stage's
        part of a global norm, which its caller completes."""
        shares = weighted_squares(
            grads, variables, self._placement, self._within_replica
        )
        return self._world.all_reduce(ops.sum(ops.stack(shares)), "sum")

    def __call__(self, grads, variables):
        """`grads` of `variables` clipped (see `clipped`)."""
        return clipped(
            grads,
            variables,
            self._placement,
            self._world,
            self.clip_norm,
            self.global_clipnorm,
            within_replica=self._within_replica,
            global_world=self._global_world,
            copies=self._copies,
        )


def clipped(
    grads,
    variables,
    placement,
    world,
    clip_norm,
    global_clip_norm,
    within_replica=False,
    global_world=None,
    copies=frozenset(),
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
        global_world: the adapter of the global norm (see
            `NormClipping.bind`); by default `world`.
        copies: ids of the variables other ranks count (see
            `NormClipping.bind`).

    Returns:
        The clipped gradients (`grads` itself when neither bound is set).
    """
    if not (clip_norm or global_clip_norm):
        return grads
    shares = weighted_squares(grads, variables, placement, within_replica)
    if global_clip_norm:
        counted = [s for s, v in zip(shares, variables) if id(v) not in copies]
        total = ops.sum(ops.stack(counted)) if counted else ops.zeros(())
        norm = ops.sqrt((global_world or world).all_reduce(total, "sum"))
        scale = global_scale(norm, global_clip_norm)
        return scaled(grads, scale)
    norms = ops.sqrt(world.all_reduce(ops.stack(shares), "sum"))
    result = []
    for i, g in enumerate(grads):
        norm = norms[i]
        safe = ops.where(norm > 0, norm, ops.ones_like(norm))
        norm = ops.where(norm > 0, safe, norm)
        scale = clip_norm / ops.maximum(norm, clip_norm)
        result.append(ops.multiply(g, ops.cast(scale, g.dtype)))
    return result


def weighted_squares(grads, variables, placement, within_replica=False):
    """Per variable, this rank's share of the squared norm of its whole
    gradient: the sum of its gradient's squares, weighted so that a piece
    several ranks hold counts once in a sum over the ranks."""
    return [
        ops.multiply(
            ops.sum(ops.square(ops.cast(g, "float32"))),
            _norm_weight(placement, v, g, within_replica),
        )
        for g, v in zip(grads, variables)
    ]


def global_scale(norm, global_clip_norm):
    """What gradients of global norm `norm` are multiplied by to clip them
    to `global_clip_norm` (Keras' `clip_by_global_norm`)."""
    scale = global_clip_norm * ops.minimum(1.0 / norm, 1.0 / global_clip_norm)
    return scale + (norm - norm)


def takes_global_norm(optimizer):
    """Whether an update in parts (a pipeline's stages) takes the norm of
    every part's gradients: to clip them by `optimizer`'s
    `global_clipnorm`, or to check its loss scale's finiteness."""
    return bool(unscaled(optimizer).global_clipnorm) or (
        loss_scale(optimizer) is not None
    )


def parts_factor(optimizer, squares, scale):
    """`(factor, finite)` from each part's squared gradient norm in
    `squares` (on one device): what every part multiplies its gradients
    by, `optimizer`'s global clip of their norm and the unscaling by a
    loss scale's value `scale` (`None` for neither); whether their norm
    is finite."""
    total = sum(squares[1:], squares[0])
    clip = unscaled(optimizer).global_clipnorm
    factor = None
    if clip:
        norm = ops.sqrt(total) if scale is None else ops.sqrt(total) / scale
        factor = global_scale(norm, clip)
    if scale is not None:
        factor = (1.0 if factor is None else factor) / scale
    return factor, ops.isfinite(total)


@contextlib.contextmanager
def global_norm_taken(optimizer):
    """Inside, `optimizer` (or a `NormClipping`) leaves its
    `global_clipnorm` to its caller, which clips by the norm over more
    gradients than it is given."""
    bound = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    try:
        yield
    finally:
        optimizer.global_clipnorm = bound


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
