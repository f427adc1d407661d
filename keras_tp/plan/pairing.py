"""Megatron pairs: the Column layers whose outputs reach one Row layer.

Read from the trace, per parent call: a Column's output reaches its Row
directly, through layers that keep the split features apart (judged by
what they compute on the traced values), or through raw ops inside the
parent, recognised by the split widths. Walks go forward in time and visit
each call once, so they end.
"""

import collections

import keras
import numpy as np

from keras_tp.plan.commuting import commutes
from keras_tp.plan.commuting import open_target
from keras_tp.plan.commuting import take
from keras_tp.plan.commuting import weightless_passing
from keras_tp.plan.dependence import carries_rank_parts
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row


class MegatronPairing:
    """The pairing walk of a `Planner` (which provides `model`, `trace`,
    `tensor_parallel`, `reasons`, `through`, `reshapes`,
    `split_tensors`, `raw_gated`, `group_of_column`, `split_blocks`,
    `blocks_of_column`, `paired_by_blocks` and `_can_split`)."""

    def _groups(self, calls, candidates, carried):
        """Megatron groups among the direct child calls of one parent.

        Walks the calls in order, keeping the Column candidates whose
        output is still open. A Row candidate closes the open Columns its
        input comes from: directly (through separable layers) or, when its
        input was made by raw ops, every open Column whose output only raw
        ops read, provided one of them splits as the Row does (`_fits`).
        A Column read directly by several Rows (Inception's 1x3 and 3x1
        convolutions of one 1x1) stays open until the last of them, and
        they all join its group: each Row sums its own output, and the
        Column's input gradient is the sum of theirs, rank by rank.

        Args:
            calls: the parent's child calls, in order.
            candidates: `id`s of the layers that may split.
            carried: the Columns of earlier parents whose output is still
                open and read by layers (`(call, consumers)`): a Row of
                another parent that reads it directly closes them (an MLP
                written as two sibling sublayers, as DeiT's). Updated in
                place with this parent's.

        Returns:
            `(groups, whole)`: `[(column calls, row calls)]`, and the calls
            that feed a group through raw ops but cannot be split on its
            axis (key/value heads fewer than the ranks): they stay whole,
            as Megatron keeps them.
        """
        open_columns = list(carried)
        unsplit = []
        groups = []
        whole = []
        for call in calls:
            if not self._candidate(call, candidates):
                continue
            if self._can_split(call.layer, Row()):
                partners = self._row_partners(call, open_columns)
                if partners:
                    if any(not s for _, s in partners):
                        whole.extend((c, id(call.layer)) for c in unsplit)
                    unsplit = []
                    group = self._join_group(partners, call)
                    if not any(g is group for g in groups):
                        groups.append(group)
                    for _, consumers in partners:
                        consumers.discard(call.index)
                    open_columns = [
                        (c, s)
                        for c, s in open_columns
                        if s or not any(c is p for p, _ in partners)
                    ]
                    continue
            if Column not in leaf_handler(call.layer).styles:
                continue
            consumers = self._span_consumers(call)
            if consumers == set():
                if self._can_split(call.layer, Column()):
                    open_columns.append((call, consumers))
                else:
                    unsplit.append(call)
            elif consumers and self._can_split(call.layer, Column()):
                open_columns.append((call, consumers))
        carried[:] = [(c, s) for c, s in open_columns if s]
        for call, _ in whole:
            self.reasons[call.layer.path] = (
                "its output meets split heads through raw ops but "
                f"{self._split_size(call)} does not divide by "
                f"tensor_parallel={self.tensor_parallel}; kept whole, as "
                "Megatron keeps key/value heads fewer than the ranks"
            )
        return groups, whole

    def _join_group(self, partners, row):
        """The group of Columns `partners` with `row` added to its Rows.

        A partner already paired with an earlier Row (several Rows read
        it) brings that group, which may come from an earlier parent.
        """
        group = next(
            (
                self.group_of_column[c.index]
                for c, _ in partners
                if c.index in self.group_of_column
            ),
            ([], []),
        )
        for column, _ in partners:
            if column.index not in self.group_of_column:
                group[0].append(column)
                self.group_of_column[column.index] = group
        group[1].append(row)
        return group

    def _split_size(self, call):
        return leaf_handler(call.layer).split_size(call.layer, Column())

    def _row_partners(self, row, open_columns):
        direct = [
            (call, consumers)
            for call, consumers in open_columns
            if consumers and row.index in consumers
        ]
        if direct:
            if not all(self._fits(call, row) for call, _ in direct):
                return []
            if not any(call.index in self.raw_gated for call, _ in direct):
                return direct
            # A gate made by raw ops (MobileNetV3's hard sigmoid) comes
            # from the Columns since whose output only raw ops read.
            first = min(call.index for call, _ in direct)
            return direct + [
                (call, consumers)
                for call, consumers in open_columns
                if consumers == set()
                and call.index > first
                and self._fits(call, row)
            ]
        source = row.inputs[0] if row.inputs else None
        producer = row.inputs and self.trace.producer.get(id(source))
        if producer and not _opaque(producer.layer):
            return []  # its input comes from a recorded, unpaired layer
        # A tensor that a Column reads (the parent's own input, which no
        # recorded call made) is not made from that Column's output.
        opaque = [
            (c, s)
            for c, s in open_columns
            if not s and not any(t is source for t in c.inputs)
        ]
        columns = [c for c, _ in opaque]
        if any(self._fits(call, row) for call in columns) and (
            carries_rank_parts(
                self.model, self.trace, row, columns, self.tensor_parallel
            )
        ):
            return opaque
        blocks = self._blocks(columns, row)
        if blocks and carries_rank_parts(
            self.model, self.trace, row, columns, self.tensor_parallel, blocks
        ):
            if not self.split_blocks:
                self.paired_by_blocks.append(row.layer.path)
                return []
            self.blocks_of_column.update(blocks)
            return opaque
        return []

    def _blocks(self, columns, row):
        """`{Column call index: blocks}` where `columns` may be fused
        projections laid out block by block for `row`, else `None`.

        A Column whose output is `b > 1` times as wide as the Row's input
        (Swin's query-key-value projection, 3 times its attention's width;
        a gate-and-up projection, twice its down projection's input) may
        hold `b` blocks side by side, each split over the ranks
        (`Column(blocks=b)`); one as wide as the Row's input holds one.
        Whether the code between them reads it so, `carries_rank_parts`
        tells.
        """
        if not row.inputs:
            return None
        width = _heads(row.inputs[0], row.layer, Row(), "input_axis")[0]
        blocks = {}
        for call in columns:
            size = _heads(call.outputs[0], call.layer, Column(), "output_axis")
            count, rest = divmod(size[0], width)
            if rest or size[0] % (count * self.tensor_parallel):
                return None
            blocks[call.index] = count
        return blocks if max(blocks.values(), default=1) > 1 else None

    def _fits(self, column, row):
        """Whether the Row call may read the Column call's split output.

        Each side splits an axis (of the Column's output, of the Row's
        input) into the ranks' blocks. Equal lengths fit, and so does a
        block of heads read as a block of features, heads first: one
        side's split length may be a multiple `k` of the other's where `k`
        divides that other side's features per head (an attention's heads
        flattened into its features, as Bloom's, Falcon's and GPT-NeoX's,
        whose fused projection holds each head's query, key and value; or
        features read back as heads, as SmolLM3's). On a rank's slices
        such code reads its config's head counts (`head_counts`), and
        where it also computes per-head constants from them (Bloom's ALiBi
        slopes) the plan's check finds the rank's numbers wrong and the
        group falls back.
        """
        if not row.inputs:
            return False
        sides = [
            _heads(column.outputs[0], column.layer, Column(), "output_axis"),
            _heads(row.inputs[0], row.layer, Row(), "input_axis"),
        ]
        (few, per_head), (many, _) = sorted(sides)
        return many % few == 0 and per_head % (many // few) == 0

    def _span_consumers(self, call):
        """Indices of the non-separable calls reading `call`'s output.

        Follows the output through layers that keep the split features
        apart (activations, dropout, pooling, a norm over another axis, a
        reshape that only adds or drops axes of length 1, a product with
        another tensor split alike or broadcast), each call once and only
        forward in time, so the walk ends. Returns an empty set when only
        raw ops read it, or `None` when a consumer is not a Row candidate
        (the output must be gathered).
        """
        if len(call.outputs) != 1:
            return None
        output = call.outputs[0]
        axis = leaf_handler(call.layer).output_axis(
            call.layer, Column(), len(output.shape)
        )
        ends = set()
        seen = set()
        through = []
        reshapes = {}
        tensors = [(output, axis)]
        while tensors:
            tensor, axis = tensors.pop()
            self.split_tensors.add(id(tensor))
            for consumer in self.trace.consumers[id(tensor)]:
                if consumer.index <= call.index or consumer.index in seen:
                    continue
                seen.add(consumer.index)
                if call.index in self.trace.ancestors(consumer):
                    continue  # inside the Column layer's own call
                if _opaque(consumer.layer) or consumer.index in (
                    self.trace.children
                ):
                    # Like raw ops (the check decides), or a layer of
                    # layers: those of its calls that read it are judged.
                    continue
                handler = leaf_handler(consumer.layer)
                passed = self._weights_passing(
                    consumer, tensor, axis, call.index
                )
                if passed is not None:
                    weights, out_axis = passed
                    if weights:
                        through.append(consumer.layer)
                    if isinstance(consumer.layer, keras.layers.Reshape):
                        reshapes[consumer.layer] = open_target(
                            consumer.layer, consumer.outputs[0], out_axis
                        )
                    tensors.extend(
                        (t, out_axis)
                        for t in consumer.outputs
                        if t is not tensor
                    )
                    continue
                if handler is None or Row not in handler.styles:
                    return None
                if not consumer.inputs or consumer.inputs[0] is not tensor:
                    return None
                ends.add(consumer.index)
        self.through[call.index] = through
        self.reshapes[call.index] = reshapes
        return ends

    def _weights_passing(self, call, tensor, axis, since):
        """How split features on `axis` of `tensor` pass `call`'s layer.

        Returns `None` if they do not, or `(weights, axis)`: the layer's
        weights split with them (`{role: slice}`, for a per-channel layer
        such as BatchNormalization, called once), or `{}` if the layer
        keeps them apart with its weights whole (an activation; a norm
        over another axis, whose weights the local-execution check then
        judges); and the axis its output has them on. `since` is the index
        of the Column call whose output is followed.
        """
        handler = leaf_handler(call.layer)
        if handler is None:

            def may_be_split(other):
                # Made after the Column, or split by another one's span;
                # what was made before it (a residual) is whole.
                producer = self.trace.producer.get(id(other))
                return (
                    id(other) in self.split_tensors
                    or producer is None
                    or producer.index > since
                )

            out_axis = weightless_passing(call, tensor, axis, may_be_split)
            if out_axis is None:
                return None
            if any(
                other is not tensor
                and other.shape[axis] == tensor.shape[axis]
                and id(other) not in self.trace.producer
                for other in call.inputs
            ):
                self.raw_gated.add(since)
            return {}, out_axis
        if Channelwise not in handler.styles:
            return None
        part = np.arange(tensor.shape[axis] // 2)
        if (
            handler.channel_length(call.layer) == tensor.shape[axis]
            and len(self.trace.calls_of[id(call.layer)]) == 1
            and self._can_split(call.layer, Channelwise())
        ):
            axes = handler.split_axes(call.layer, Channelwise())
            weights = {
                role: take(variable, part, axes[role])
                for role, variable in handler.variables(call.layer).items()
            }
            if commutes(call, tensor, axis, weights):
                return weights, axis
        return ({}, axis) if commutes(call, tensor, axis) else None

    def local_reshapes(self, decisions):
        """`{Reshape layer: {"target_shape": shape}}`: the reshapes on the
        way from a Column still paired to its Rows, which a rank runs with
        the split axis of their target shape inferred."""
        shapes = {}
        for index, reshapes in self.reshapes.items():
            decision = decisions.get(id(self.trace.calls[index].layer))
            if decision is not None and decision.paired:
                for layer, target in reshapes.items():
                    shapes[layer] = {"target_shape": target}
        return shapes

    def _paired_unlike(self, groups):
        """`id`s of the layers whose calls are not all paired alike.

        A layer called several times (the block Albert shares between
        its layers, a Siamese tower) splits one way for all its calls, so
        each call must be in a group of the same Column and Row layers;
        the groups holding any other call stay unpaired.
        """
        shapes = collections.defaultdict(set)
        calls = collections.Counter()
        for columns, rows in groups:
            shape = (
                frozenset(id(call.layer) for call in columns),
                frozenset(id(call.layer) for call in rows),
            )
            for call in columns + rows:
                shapes[id(call.layer)].add(shape)
                calls[id(call.layer)] += 1
        return {
            layer
            for layer, seen in shapes.items()
            if len(seen) > 1 or calls[layer] != len(self.trace.calls_of[layer])
        }

    def _candidate(self, call, candidates):
        return id(call.layer) in candidates and call.outputs


def _heads(tensor, layer, style, axis_of):
    """`(split length, features per unit of it)` of `layer`'s `tensor`."""
    axis = getattr(leaf_handler(layer), axis_of)(
        layer, style, len(tensor.shape)
    )
    units = tensor.shape[axis]
    return units, int(np.prod(tensor.shape[axis:])) // units


def _opaque(layer):
    """A layer of another library with no weights: read like raw ops.

    Keras' own layers are known to the planner; a weightless layer from
    elsewhere (a rotary embedding, say) may or may not keep the split
    features apart, which only the local-execution check can tell.
    """
    return not layer.weights and not type(layer).__module__.startswith("keras.")
