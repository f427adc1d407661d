"""Sharding styles: what a layer becomes under tensor parallelism."""

import collections


class ShardingStyle:
    """Base class of the styles a `ShardingPlan` assigns to layers."""

    def _fields(self):
        return {}

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other):
        return type(self) is type(other) and self._fields() == other._fields()

    def __hash__(self):
        return hash((type(self), tuple(self._fields().items())))


class Column(ShardingStyle):
    """Splits a layer's output features across ranks (Megatron column).

    The kernel is split on its output axis (the heads axis of an attention
    projection, the filters of a convolution) and so is the bias. The
    replicated input enters through `copy_to_parallel`, so the backward pass
    all-reduces its gradient once.

    Args:
        gather_output: if `True`, all-gather the output so the next layer
            sees the full features. Leave `False` when a `Row` layer
            consumes the output: it stays sharded and no collective runs.
        blocks: the number of blocks a fused projection lays side by side
            on its output features (3 for a query-key-value projection
            whose output is reshaped to `(..., 3, heads, head_dim)`, 2 for
            a gate-and-up projection). Each rank holds its part of EACH
            block, as Megatron splits such a projection by heads; keras_tp
            stores the variables permuted so (`keras_tp.blocks`), and full
            values and checkpoints stay in the layer's own layout.

    Example:

    >>> plan = ShardingPlan({"up/kernel": Column(), "down/kernel": Row()})
    """

    def __init__(self, gather_output=False, blocks=1):
        self.gather_output = bool(gather_output)
        self.blocks = int(blocks)
        if self.blocks < 1 or (self.blocks > 1 and self.gather_output):
            raise ValueError(
                f"Column(blocks={blocks!r}, gather_output={gather_output!r}): "
                "blocks must be a positive count, and a gathering Column "
                "gathers its whole output, so it takes blocks=1."
            )

    def _fields(self):
        fields = {"gather_output": self.gather_output}
        if self.blocks > 1:
            fields["blocks"] = self.blocks
        return fields


class Row(ShardingStyle):
    """Splits a layer's input features across ranks (Megatron row).

    The kernel is split on its contracted axis; each rank multiplies its
    slice of the input, the partial results are all-reduced, and then the
    (replicated) bias and the activation are applied once.

    Args:
        input_is_parallel: `True` when the input arrives split, as the
            output of a `Column` layer. `False` slices a replicated input
            locally (its gradient is all-gathered in the backward pass).
    """

    def __init__(self, input_is_parallel=True):
        self.input_is_parallel = bool(input_is_parallel)

    def _fields(self):
        return {"input_is_parallel": self.input_is_parallel}


class Vocab(ShardingStyle):
    """Splits an embedding table's rows (the vocabulary) across ranks.

    Each rank looks up the ids that fall in its range, writes zeros for the
    rest, and one all-reduce assembles the embeddings.
    """


class Replicate(ShardingStyle):
    """Keeps the layer whole on every rank."""


class Channelwise(ShardingStyle):
    """Splits a per-channel layer with the channels it receives split.

    For a layer that acts on each channel on its own (BatchNormalization,
    a depthwise convolution, a per-channel scale) between a `Column` layer
    and its `Row` partner: every weight is split on its channel axis, and
    the layer runs unchanged on each rank's channels, with no collective.
    BatchNormalization keeps its statistics local: a rank's channels are
    normalised over the batch exactly as on one device.
    """


class ExpertParallel(ShardingStyle):
    """Splits a bank of experts: each rank holds `experts / N` of them.

    Every weight of the layer is split on its leading (experts) axis, as
    in torchtitan's and Megatron's expert parallelism. Each rank runs the
    layer's own `call` on its experts; their outputs are gathered on
    `output_axis`, or summed when `output_axis` is `None` (a layer that
    combines its experts itself).

    Args:
        output_axis: the experts axis of the output, or `None`.
    """

    def __init__(self, output_axis=0):
        self.output_axis = output_axis

    def _fields(self):
        return {"output_axis": self.output_axis}


Decision = collections.namedtuple(
    "Decision",
    ["layer", "style", "group", "source", "paired"],
    defaults=[False],
)
Decision.__doc__ = """How one supported layer (or attention unit) is split:
its style, the id of its Megatron group (layers paired together fall back
together), what decided it, and whether it is in a Column -> Row pair."""
