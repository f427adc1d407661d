"""Sequence parallelism: activations between regions split on the sequence.

Tensor parallelism leaves the activations between its regions (the norms,
dropouts and residual adds of a transformer) whole on every rank. Megatron's
sequence parallelism (Korthikanti et al., 2022) splits them on the sequence
axis instead: a region that ends in an all-reduce reduce-scatters over the
sequence, and a region's replicated input is all-gathered over the sequence
where it enters. The bytes on the wire stay the same; the activations
between regions take `1 / size()` of the memory.

`SequenceParallelAdapter` wraps a `model`-axis adapter so that the layer
handlers' per-rank math stays as it is: their `reduce_from_parallel` of a
sequence activation becomes `reduce_scatter_sequence`. The runtime gathers
the sequence shards where a region's inputs enter (`gather_sequence`).

A sequence activation is a region's `(batch, sequence, features)` output
that carries its input's batch and sequence axes (`region_inputs`): an
attention's or an MLP's output, or an embedding's lookup of `(batch,
sequence)` token ids. A region whose input has no sequence axis, such as
the experts of a mixture of experts called on the flattened tokens,
reduces its output whole.
"""

import contextlib
import contextvars
import warnings

import keras

from keras_tp.collectives.base import CollectiveAdapter
from keras_tp.plan.trace import probe_inputs

# Activations of shape (batch, sequence, features) are split on axis 1.
SEQUENCE_AXIS = 1
SEQUENCE_RANK = 3


# The (batch, sequence) sizes of the input of the region being computed.
_REGION_SEQUENCE = contextvars.ContextVar(
    "keras_tp_region_sequence", default=None
)


def is_sequence(x):
    """Whether `x` is a sequence activation: `(batch, sequence, features)`."""
    return len(x.shape) == SEQUENCE_RANK


def has_sequence_axis(x):
    """Whether axis 1 of `x` is a sequence: `(batch, sequence, ...)`
    activations, or `(batch, sequence)` integer token ids."""
    if not hasattr(x, "shape"):
        return False
    rank = len(x.shape)
    dtype = keras.backend.standardize_dtype(x.dtype)
    return rank >= SEQUENCE_RANK or (rank == 2 and "int" in dtype)


def warn_without_sequence_axis(model):
    """Warns that sequence parallelism leaves `model` as it is: none of its
    inputs has a sequence axis, so no activation between its split layers
    is split (a model that makes one inside, by a reshape, is split)."""
    try:
        inputs = keras.tree.flatten(probe_inputs(model, batch=1))
    except ValueError:
        return  # No known input shape: nothing to tell from.
    if any(has_sequence_axis(x) for x in inputs):
        return
    shapes = [(None, *x.shape[1:]) for x in inputs]
    warnings.warn(
        "sequence_parallel=True splits (batch, sequence, ...) activations "
        f"on their sequence axis, but the inputs of model '{model.name}' "
        f"have none: shapes {shapes}. Unless the model makes one inside (a "
        "Reshape), it splits nothing: pass sequence_parallel=False.",
        stacklevel=4,
    )


@contextlib.contextmanager
def region_inputs(main):
    """The context of a region's per-rank call whose main input (its
    layer's first argument) is `main`.

    Notes the batch and sequence sizes of `main`, where it has them:
    `(batch, sequence, ...)` activations (an attention's output projection
    takes `(batch, sequence, heads, head_dim)`) or `(batch, sequence)`
    integer token ids. Only an output that carries them is reduce-scattered
    over the sequence.
    """
    sizes = None
    if main is not None and has_sequence_axis(main):
        sizes = tuple(main.shape[:2])
    token = _REGION_SEQUENCE.set(sizes)
    try:
        yield
    finally:
        _REGION_SEQUENCE.reset(token)


class SequenceParallelAdapter:
    """A `model`-axis adapter whose regions leave the sequence split.

    Every attribute but `reduce_from_parallel` and `activated` is the
    wrapped adapter's.

    Args:
        adapter: the `CollectiveAdapter` of the `model` axis.
    """

    def __init__(self, adapter):
        self.inner = adapter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def stats(self):
        return self.inner.stats

    @stats.setter
    def stats(self, stats):
        self.inner.stats = stats

    def reduce_from_parallel(self, x):
        """Reduce-scatters a sequence activation's partial sums over the
        sequence; reduces any other tensor whole."""
        sizes = _REGION_SEQUENCE.get()
        if not is_sequence(x) or tuple(x.shape[:2]) != sizes:
            return self.inner.reduce_from_parallel(x)
        size = self.inner.size()
        if x.shape[SEQUENCE_AXIS] is None:
            raise ValueError(
                "sequence_parallel=True splits a split layer's output over "
                "its sequence axis (1), whose length is unknown here: "
                f"shape {tuple(x.shape)}. TensorFlow traces a step for "
                "batches of different lengths with the length unknown. Pad "
                "every batch to one sequence length, or pass "
                "sequence_parallel=False."
            )
        if x.shape[SEQUENCE_AXIS] % size:
            raise ValueError(
                "sequence_parallel=True reduce-scatters a split layer's "
                f"output, of shape {tuple(x.shape)}, over its sequence axis "
                f"({SEQUENCE_AXIS}) across {size} devices, so the sequence "
                f"length must divide by {size}. Pad the sequences to a "
                "multiple of it, or pass sequence_parallel=False."
            )
        return self.inner.reduce_scatter_sequence(x, SEQUENCE_AXIS)

    @contextlib.contextmanager
    def activated(self):
        """Makes this adapter the one `keras_tp.collectives` functions use."""
        with CollectiveAdapter.activated(self):
            yield self
