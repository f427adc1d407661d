"""Cutting a Functional model into pipeline stages.

A pipeline runs consecutive parts of a model, its *stages*, on different
devices, and sends the activations that cross each cut from one stage to
the next. `split_stages` makes those parts: Functional models built from
the user's own layer objects, so that training the stages trains the
user's model.

Where to cut: at the positions of the graph where the fewest activations
cross (between the blocks of a transformer, the residual stream; between
the blocks of a ResNet, the block's output), choosing among them the cuts
that balance the stages' parameters. Tensors that a later stage reads but
an earlier one made (skip connections, and model inputs such as keras-hub's
`padding_mask`, which every transformer block reads) are carried: they
become extra outputs of the stages they pass through and extra inputs of
the next ones.
"""

import difflib
import inspect
import logging
import re
import time

import keras
import numpy as np

from keras_tp.keras_internals import sublayers
from keras_tp.pipeline.graph import Dataflow

logger = logging.getLogger(__name__)

BALANCES = ("parameters", "time")
# Timed runs of each block for `balance="time"`, after one warm-up run.
TIMED_RUNS = 5


class BoundaryTensor:
    """One tensor sent from a stage to the next.

    Attributes:
        name: its stable name (the producing layer or op, or the model
            input); the receiving stage model's input of that name.
        shape: its shape; the first dimension is the batch, `None`, as
            are other unknown dimensions.
        dtype: its dtype, a string.
        carried: whether the sending stage only passes it on (it received
            it, or it is a model input or an early output): a skip
            connection or an input such as a padding mask.
    """

    def __init__(self, name, shape, dtype, carried):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = keras.backend.standardize_dtype(dtype)
        self.carried = carried

    def nbytes(self, batch_size, sequence_length=None):
        """Bytes of this tensor for a batch.

        Args:
            batch_size: the batch (first) dimension, usually the size of a
                microbatch.
            sequence_length: the size to use for every other unknown
                dimension (the sequence axis of a text model).

        Returns:
            An int.

        Raises:
            ValueError: if the tensor has an unknown dimension other than
                the batch and `sequence_length` is not given.
        """
        size = 1
        for i, dim in enumerate(self.shape):
            if dim is None:
                dim = batch_size if i == 0 else sequence_length
            if dim is None:
                raise ValueError(
                    f"Boundary tensor '{self.name}' has shape {self.shape}: "
                    "dimensions other than the batch are unknown. Pass "
                    "`sequence_length=` (used for each of them), or build "
                    "the model on inputs of fixed shape."
                )
            size *= int(dim)
        return int(size * _itemsize(self.dtype))

    def __repr__(self):
        return (
            f"BoundaryTensor({self.name!r}, shape={self.shape}, "
            f"dtype={self.dtype!r}, carried={self.carried})"
        )


class Boundary:
    """A cut: the tensors stage `index` sends to stage `index + 1`.

    Attributes:
        index: the sending stage.
        tensors: the `BoundaryTensor`s, in a fixed order (model inputs
            first, then by the position of the node that made them).
    """

    def __init__(self, index, tensors):
        self.index = index
        self.tensors = list(tensors)

    @property
    def names(self):
        return [t.name for t in self.tensors]

    def nbytes(self, batch_size, sequence_length=None):
        """Bytes sent across this cut for a batch (see `BoundaryTensor`)."""
        return sum(t.nbytes(batch_size, sequence_length) for t in self.tensors)

    def __repr__(self):
        return f"Boundary({self.index}, {self.names})"


class Stage:
    """One stage of a pipeline.

    Attributes:
        index: its position, from 0.
        model: a Functional model of the user's own layers. Stage 0 takes
            the original model's inputs; a later stage takes a dict of the
            tensors it receives, by name. A stage other than the last
            returns a dict of the tensors it sends, by name; the last
            returns the original model's outputs.
        layer_names: the names of the layers called in this stage, in
            order (layers of nested models included, without prefix).
        operation_names: the names of all nodes of this stage, raw ops
            included (`add`, `cast_2`, ...), as `cut_points` accepts them.
        input_names: names of the tensors it receives (stage 0: the
            model's input names).
        output_names: names of the tensors it sends (the last stage: the
            model's output names).
        parameter_count: number of scalars in its weights (trainable and
            not), as `model.count_params()` counts them.
    """

    def __init__(
        self,
        index,
        model,
        layer_names,
        operation_names,
        input_names,
        output_names,
        parameter_count,
    ):
        self.index = index
        self.model = model
        self.layer_names = layer_names
        self.operation_names = operation_names
        self.input_names = input_names
        self.output_names = output_names
        self.parameter_count = parameter_count

    def __repr__(self):
        return (
            f"<Stage {self.index}: {len(self.layer_names)} layers, "
            f"{self.parameter_count} parameters>"
        )


class StageSplit:
    """A model cut into pipeline stages: what `split_stages` returns.

    Attributes:
        model: the original model.
        stages: the `Stage`s, in order.
        boundaries: the `Boundary` of each cut, `len(stages) - 1` of them.
        cut_points: the name of the first node of each stage after the
            first; `split_stages(model, n, cut_points=split.cut_points)`
            makes the same split.
        balance: what the automatic cuts balanced (`"parameters"`), or
            `None` where the user gave the cut points.
        candidate_cut_points: the names of the nodes at which automatic
            cuts may start a stage (where the fewest activations cross),
            in order; at most `len(candidate_cut_points) + 1` stages can
            be cut automatically.
        shared_weights: `{weight path: [stage indices]}` of the weights
            that several stages use (a tied embedding, which also
            computes the logits), with `share_weights=True`.
    """

    def __init__(self, model, stages, boundaries, cut_points, balance):
        self.model = model
        self.stages = stages
        self.boundaries = boundaries
        self.cut_points = cut_points
        self.balance = balance
        self.candidate_cut_points = []
        self.shared_weights = {}
        for variable in model.weights:
            using = [
                stage.index
                for stage in stages
                if any(v is variable for v in stage.model.weights)
            ]
            if len(using) > 1:
                self.shared_weights[variable.path] = using

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def parameter_counts(self):
        return [stage.parameter_count for stage in self.stages]

    def bytes_per_cut(self, batch_size, sequence_length=None):
        """Bytes sent across each cut in one forward pass of a batch.

        This is the pipeline's point-to-point traffic per microbatch: the
        backward pass sends gradients of the same shapes back (integer and
        boolean tensors, such as a padding mask, have none).

        Args:
            batch_size: the batch of one send, usually the microbatch size.
            sequence_length: the size of every unknown dimension other
                than the batch (the sequence axis of a text model).

        Returns:
            A list of ints, one per cut.
        """
        return [b.nbytes(batch_size, sequence_length) for b in self.boundaries]

    def run(self, inputs, training=False):
        """Runs the stages one after the other on one device.

        The result is the original model's output (up to float rounding):
        a check of the split, and the reference a pipeline is tested
        against.
        """
        outputs = inputs
        for stage in self.stages:
            outputs = stage.model(outputs, training=training)
        return outputs

    def summary(self, sequence_length=None):
        """A text table of the stages.

        One row per stage: its layers (first, last, count), its
        parameters, and what it sends to the next stage, with bytes per
        sample. Where a boundary tensor has unknown dimensions besides the
        batch and `sequence_length` is not given, bytes are shown per
        unit of each (`512·L`).

        Returns:
            A string.
        """
        total = sum(self.parameter_counts) or 1
        rows = [("stage", "layers", "parameters", "sends", "bytes/sample")]
        for stage in self.stages:
            names = stage.layer_names or stage.operation_names
            if len(names) > 2:
                layers = f"{names[0]} .. {names[-1]} ({len(names)})"
            else:
                layers = ", ".join(names)
            parameters = (
                f"{stage.parameter_count:,} "
                f"({100 * stage.parameter_count / total:.1f}%)"
            )
            if stage.index < len(self.boundaries):
                boundary = self.boundaries[stage.index]
                sends = ", ".join(
                    f"{t.name}{'*' if t.carried else ''} "
                    f"{_shape_text(t.shape)} {t.dtype}"
                    for t in boundary.tensors
                )
                per_sample = _bytes_text(boundary.tensors, sequence_length)
            else:
                sends, per_sample = "(model outputs)", ""
            rows.append(
                (str(stage.index), layers, parameters, sends, per_sample)
            )
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        how = f"balanced by {self.balance}" if self.balance else "user cuts"
        lines = [
            f"Pipeline stages of '{self.model.name}': {self.num_stages} "
            f"stages, {sum(self.parameter_counts):,} parameters, {how}"
        ]
        for row in rows:
            cells = [row[i].ljust(widths[i]) for i in range(4)] + [row[4]]
            lines.append("  ".join(cells).rstrip())
        lines.append("* carried: passed on, not computed, by the stage")
        return "\n".join(lines)

    def __repr__(self):
        return (
            f"<StageSplit of '{self.model.name}': {self.num_stages} stages, "
            f"parameters {self.parameter_counts}>"
        )


def split_stages(
    model,
    num_stages,
    cut_points=None,
    balance="parameters",
    sample=None,
    share_weights=False,
):
    """Cuts a Functional model into consecutive pipeline stages.

    Each stage is a Functional model made of the user's own layer objects
    (the same variables: nothing is copied or initialised again), so
    training the stages trains `model`, and `model.get_weights()` sees it.
    Run one after the other, the stages compute exactly what `model`
    computes (`StageSplit.run`).

    The cut points are positions in a topological order of the model's
    graph: its layer calls and raw-op calls (such as the `x + y` of a
    residual add). Nested Functional and Sequential models called once
    (the backbone of a keras-hub `CausalLM` or classifier) are opened up,
    so a cut can fall between their layers; a nested model that cannot be
    (called on a structure unlike its inputs, or with tensors in keyword
    arguments) stays one node, whose layers then all go to one stage.

    Automatic cuts (`cut_points=None`): the candidates are the positions
    where the fewest activations cross the cut, not counting the model
    inputs a stage carries (keras-hub's `padding_mask`) nor model outputs
    already made: between the blocks of a transformer, the residual
    stream; between ResNet blocks, the block's output. Cuts that would put
    the calls of one layer (or two layers sharing a weight) in different
    stages are not candidates, unless `share_weights`. Among the
    candidates, the `num_stages - 1` cuts are chosen that make the largest
    stage smallest (by parameters), then the stages most even.

    User cuts: `cut_points=["block_2", "block_4"]` starts a new stage *at*
    each named layer: stage 0 runs up to, not including, `block_2`.
    Names are layer or op names (`StageSplit.cut_points` and
    `Stage.operation_names` list them), in the order the model runs them;
    a layer inside a nested model may be named with or without the nested
    model's name (`gpt2_backbone.transformer_layer_1`).

    Tensors made before a cut and read after it (skip connections, model
    inputs read by every block) cross each cut up to their last reader:
    they are outputs of the stages they pass through and inputs of the
    next ones. `StageSplit.boundaries` lists them per cut. A tensor made
    once and read by every block (T5's position bias, a long skip) thus
    crosses every cut in between, and automatic cuts, which look for the
    fewest crossing activations, then fall only outside that span: pass
    `cut_points` there.

    Args:
        model: a built Functional or Sequential Keras model (keras-hub
            backbones and task models, `keras.applications` models).
        num_stages: number of stages, at least 1.
        cut_points: `None` for automatic cuts, or the names of the
            `num_stages - 1` layers at which a new stage starts.
        balance: what automatic cuts balance: `"parameters"` (the number
            of weight scalars per stage, a proxy for both compute and
            memory), or `"time"`: the forward time of each stage, measured
            on `sample` here, block by block between the candidate cuts
            (the median of a few runs after a warm-up run).
        sample: with `balance="time"`, a batch of the model's inputs.
        share_weights: whether cuts may separate the calls of one layer
            (or of layers sharing a weight): each stage that calls it
            then holds the weight (`StageSplit.shared_weights`), and the
            pipeline must keep those copies equal, as Megatron-LM does
            with the word embeddings of its first and last stages.

    Returns:
        A `StageSplit`.

    Raises:
        NotImplementedError: for a subclassed model (its `call` is opaque).
        ValueError: for a bad `num_stages`, `cut_points` or `balance`; for
            cuts that separate the calls of one layer, without
            `share_weights` (keras-hub's `CausalLM`s use the token
            embedding for the logits too); for layers that add losses in
            `call`.

    Example:

    ```python
    from keras_tp.pipeline import split_stages

    split = split_stages(backbone, num_stages=4)
    print(split.summary(sequence_length=1024))
    outputs = split.run(x)            # == backbone(x)
    sent = split.stages[0].model(x)
    # {"padding_mask": ..., "transformer_layer_5": ...}: the padding mask,
    # carried, and the residual stream after block 5.
    ```
    """
    if isinstance(num_stages, bool) or not isinstance(
        num_stages, (int, np.integer)
    ):
        raise TypeError(f"num_stages must be an int, got {num_stages!r}.")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
    if balance not in BALANCES:
        raise ValueError(
            f"Unknown balance {balance!r}; supported: "
            f"{', '.join(repr(b) for b in BALANCES)}."
        )
    if (balance == "time") != (sample is not None):
        raise ValueError(
            "balance='time' times the model's blocks on a batch of its "
            "inputs and needs one: pass sample=x with it (and only with "
            f"it); got balance={balance!r} and "
            f"sample={'None' if sample is None else 'a batch'}."
        )
    graph = Dataflow(model)
    _check_losses(model)
    sizes = _node_parameters(graph)
    owners = [] if share_weights else _weight_owners(graph)
    found = _candidates(graph, owners)
    if cut_points is None:
        if balance == "time" and num_stages > 1:
            sizes = _block_seconds(graph, found[0], sample)
        positions = _automatic_cuts(graph, num_stages, sizes, owners, found)
        chosen_balance = balance
    else:
        positions = _user_cuts(graph, num_stages, cut_points, owners)
        chosen_balance = None
    split = _build(graph, positions, chosen_balance)
    split.candidate_cut_points = [graph.nodes[k].name for k in found[0]]
    logger.info("%s", split)
    return split


# Graph measurements ----------------------------------------------------


def _lifetimes(graph):
    """`{key: (first, last)}`: the cuts each tensor crosses.

    A cut `k` (`1 <= k < n`) separates nodes `[0, k)` from `[k, n)`; a
    tensor crosses it when it exists before (a model input, or made by a
    node before `k`) and is needed after (read by a node at or after `k`,
    or a model output).
    """
    n = len(graph.nodes)
    outputs = set(graph.outputs)
    spans = {}
    for key, info in graph.tensors.items():
        first = 0 if info.producer is None else info.producer + 1
        last = max(info.consumers, default=-1)
        if key in outputs:
            last = n
        spans[key] = (first, last)
    return spans


def _crossing(graph, spans, k):
    """Keys of the tensors crossing cut `k`, in a fixed order."""
    return [
        key
        for key in _tensor_order(graph)
        if spans[key][0] <= k <= spans[key][1]
    ]


def _tensor_order(graph):
    order = list(graph.inputs)
    for node in graph.nodes:
        for key in node.outputs:
            if graph.tensors[key].producer == node.index:
                order.append(key)
    return order


def _activation_counts(graph, spans):
    """Per cut `k`, the crossing tensors that count against it.

    Model inputs crossing a cut are carried wherever they are still read,
    and a model output made earlier is carried to the end: they cross many
    cuts alike and say nothing about where a block ends. The others are
    the activations a cut must send.
    """
    n = len(graph.nodes)
    delta = np.zeros(n + 2, dtype=np.int64)
    outputs = set(graph.outputs)
    for key, info in graph.tensors.items():
        if info.producer is None:
            continue
        first, last = spans[key]
        if key in outputs:
            last = first
        if last >= first:
            delta[first] += 1
            delta[last + 1] -= 1
    return np.cumsum(delta)[: n + 1]


def _node_parameters(graph):
    """Weight scalars per node; a weight counts at its first use only."""
    seen = set()
    sizes = []
    for node in graph.nodes:
        size = 0
        for weight in getattr(node.operation, "weights", ()):
            if id(weight) not in seen:
                seen.add(id(weight))
                size += int(np.prod(weight.shape))
        sizes.append(size)
    return sizes


def _weight_owners(graph):
    """`[(label, first node, last node)]` for weights used by several nodes.

    A layer called twice (a tied embedding, also the LM head), or two
    layers that share a variable, must have all those calls in one stage:
    a stage owns its weights.
    """
    uses = {}
    for node in graph.nodes:
        for weight in getattr(node.operation, "weights", ()):
            uses.setdefault(id(weight), (weight, []))[1].append(node)
    spans = {}
    for weight, nodes in uses.values():
        if nodes[0].index == nodes[-1].index:
            continue
        layers = []
        for node in nodes:
            if node.operation.name not in layers:
                layers.append(node.operation.name)
        span = (nodes[0].index, nodes[-1].index)
        label = (tuple(layers), weight.path)
        spans.setdefault(label, span)
    return [(label, a, b) for label, (a, b) in spans.items()]


def _block_seconds(graph, candidates, sample):
    """Forward seconds per node: each block's between the candidate cuts,
    measured on `sample`, counted at the block's first node.

    The blocks run one after the other as the stages of a split at every
    candidate, each on the previous one's outputs, as a pipeline would
    run them.
    """
    blocks = _build(graph, list(candidates), None)
    seconds = [0.0] * len(graph.nodes)
    starts = [0] + list(candidates)
    # Converted once, so that the first block's times do not include it.
    inputs = keras.tree.map_structure(keras.ops.convert_to_tensor, sample)
    for start, stage in zip(starts, blocks.stages):
        outputs = _wait(stage.model(inputs))
        runs = []
        for _ in range(TIMED_RUNS):
            began = time.perf_counter()
            _wait(stage.model(inputs))
            runs.append(time.perf_counter() - began)
        seconds[start] = float(np.median(runs))
        inputs = outputs
    return seconds


def _wait(outputs):
    """`outputs` once computed: backends may return before they are."""
    for tensor in keras.tree.flatten(outputs):
        keras.ops.convert_to_numpy(tensor)
    return outputs


# Choosing cuts ---------------------------------------------------------


def _candidates(graph, owners):
    """Where automatic cuts may go.

    Returns:
        `(candidates, fewest, splitting)`: the cuts where the fewest
        activations cross, that number, and `{cut: label}` for the cuts
        excluded because they would separate the calls of a shared
        weight's layers.
    """
    n = len(graph.nodes)
    counts = _activation_counts(graph, _lifetimes(graph))
    splitting = {}
    for label, first, last in owners:
        for k in range(first + 1, last + 1):
            splitting.setdefault(k, label)
    allowed = [k for k in range(1, n) if k not in splitting]
    if not allowed:
        return [], None, splitting
    fewest = min(counts[k] for k in allowed)
    return [k for k in allowed if counts[k] == fewest], fewest, splitting


def _automatic_cuts(graph, num_stages, sizes, owners, found):
    n = len(graph.nodes)
    if num_stages == 1:
        return []
    candidates, fewest, splitting = found
    if not candidates:
        if splitting:
            raise ValueError(_tie_message(graph, splitting[1], owners))
        raise ValueError(
            f"Model '{graph.model.name}' has {n} node(s) and cannot be cut "
            f"into {num_stages} stages."
        )
    if num_stages > len(candidates) + 1:
        where = ", ".join(f"'{graph.nodes[k].name}'" for k in candidates[:12])
        more = " ..." if len(candidates) > 12 else ""
        tied = ""
        if splitting:
            tied = (
                " Cuts that would separate the calls of a shared layer "
                "are excluded: "
                + _tie_message(graph, next(iter(splitting.values())), owners)
            )
        raise ValueError(
            f"Model '{graph.model.name}' has {len(candidates)} candidate "
            f"cut point(s), where {fewest} activation(s) cross (new stages "
            f"could start at {where}{more}), so at most "
            f"{len(candidates) + 1} stages; got num_stages={num_stages}. "
            "Use fewer stages, or pass `cut_points=` (names of the layers "
            f"at which stages start).{tied}"
        )
    weights = list(sizes)
    if sum(weights) == 0:
        weights = [1] * n  # no parameters at all: balance node counts
    cuts = _balanced(weights, candidates, num_stages)
    logger.info(
        "Cut '%s' at %s among %d candidates.",
        graph.model.name,
        [graph.nodes[k].name for k in cuts],
        len(candidates),
    )
    return cuts


def _balanced(weights, candidates, num_stages):
    """The cuts among `candidates` that balance `weights` best.

    First the largest stage is made as small as possible (a pipeline runs
    at the pace of its slowest stage), then, among the cuts that reach
    it, the sum of squared stage weights is made smallest (the other
    stages as even as they can be). Among equal choices a later cut wins,
    so parameterless layers (activations, dropout) stay with the layer
    before them.
    """
    prefix = np.concatenate([[0], np.cumsum(weights)]).tolist()
    ends = [0] + list(candidates) + [len(weights)]
    m = len(ends)

    def load(i, j):
        return prefix[ends[j]] - prefix[ends[i]]

    def solve(cost, combine, limit):
        inf = float("inf")
        best = [[inf] * m for _ in range(num_stages + 1)]
        parent = [[None] * m for _ in range(num_stages + 1)]
        best[0][0] = 0
        for s in range(1, num_stages + 1):
            for j in range(s, m):
                if s == num_stages and j != m - 1:
                    continue
                for i in range(s - 1, j):
                    if best[s - 1][i] == inf or load(i, j) > limit:
                        continue
                    value = combine(best[s - 1][i], cost(load(i, j)))
                    if value <= best[s][j]:
                        best[s][j] = value
                        parent[s][j] = i
        return best[num_stages][m - 1], parent

    bottleneck, _ = solve(lambda w: w, max, float("inf"))
    _, parent = solve(lambda w: w * w, lambda a, b: a + b, bottleneck)
    cuts = []
    j = m - 1
    for s in range(num_stages, 1, -1):
        j = parent[s][j]
        cuts.append(ends[j])
    return sorted(cuts)


def _user_cuts(graph, num_stages, cut_points, owners):
    if isinstance(cut_points, str) or not isinstance(cut_points, (list, tuple)):
        raise TypeError(
            "cut_points must be a list of layer names (the layers at which "
            f"new stages start), got {cut_points!r}."
        )
    if len(cut_points) != num_stages - 1:
        raise ValueError(
            f"num_stages={num_stages} needs {num_stages - 1} cut point(s), "
            "the names of the layers at which stages 1.. start; got "
            f"{len(cut_points)}: {list(cut_points)}."
        )
    positions = [_find_node(graph, name) for name in cut_points]
    previous = 0
    for name, k in zip(cut_points, positions):
        if k == 0:
            raise ValueError(
                f"Cut point '{name}' is the first node of model "
                f"'{graph.model.name}': stage 0 would be empty. Name the "
                "layer at which the *second* stage starts."
            )
        if k <= previous:
            before = cut_points[positions.index(previous)]
            raise ValueError(
                f"Cut point '{name}' (node {k}) does not come after "
                f"'{before}' (node {previous}) in the order model "
                f"'{graph.model.name}' runs its layers. List cut points in "
                "that order, each once; `split.stages[i].operation_names` "
                "shows it."
            )
        previous = k
    for label, first, last in owners:
        for k in positions:
            if first < k <= last:
                raise ValueError(_tie_message(graph, label, owners))
    return positions


def _find_node(graph, name):
    if not isinstance(name, str):
        raise TypeError(f"A cut point must be a layer name, got {name!r}.")
    exact = [n.index for n in graph.nodes if n.name == name]
    if exact:
        return exact[0]
    matches = [
        n
        for n in graph.nodes
        if n.operation.name == name or n.name.split(":")[0].endswith("." + name)
    ]
    if not matches:
        names = [n.name for n in graph.nodes] + [
            n.operation.name for n in graph.nodes
        ]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {close}?" if close else ""
        opaque = ""
        if graph.opaque:
            opaque = (
                f" Nested models {graph.opaque} are kept whole: their "
                "layers cannot be cut points."
            )
        raise ValueError(
            f"Model '{graph.model.name}' has no layer named '{name}' to "
            f"start a stage at.{hint}{opaque} Cut points are layer (or op) "
            "names as `model.summary()` shows them."
        )
    if len(matches) > 1:
        raise ValueError(
            f"'{name}' names {len(matches)} calls in model "
            f"'{graph.model.name}': {[n.name for n in matches]}. Name one "
            "of them exactly."
        )
    return matches[0].index


def _tie_message(graph, label, owners):
    layers, path = label
    first, last = next((a, b) for lab, a, b in owners if lab == label)
    what = (
        f"layer '{layers[0]}' is called"
        if len(layers) == 1
        else f"layers {list(layers)} share weight '{path}' and are called"
    )
    return (
        f"In model '{graph.model.name}', {what} at "
        f"'{graph.nodes[first].name}' and at '{graph.nodes[last].name}', "
        "and a cut between them would need its weights in two stages. The "
        "usual case is a token embedding that also computes the logits "
        "(keras-hub's `ReversibleEmbedding` in GPT2, Gemma and Llama "
        "CausalLMs). Pass share_weights=True to give each stage that calls "
        "it a copy (TensorParallelKeras' pipelines do, and keep the copies "
        "equal), choose cut points so that all its calls fall in one "
        "stage, or pipeline the backbone (`split_stages(model.backbone, "
        "...)`)."
    )


def _check_losses(model):
    """Refuses layers that add losses in `call`: a stage cannot return them.

    Activity regularizers are found from the layers' attributes; `add_loss`
    in a layer's `call` from the source of the `call` that runs (a
    mixture-of-experts router's auxiliary loss), or, where the call adds
    it elsewhere, after the model has run eagerly (its losses are then
    listed in `model.losses`).
    """
    for layer in [model] + list(sublayers(model)):
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer '{layer.name}' of model '{model.name}' has an "
                "activity regularizer, which adds a loss during `call`; "
                "pipeline stages do not pass such losses on. Remove it "
                "(or regularize the weights instead) before splitting."
            )
        if _adds_loss_in_call(layer):
            raise ValueError(
                f"Layer '{layer.name}' of model '{model.name}' calls "
                "`add_loss` in its `call` (a mixture-of-experts router's "
                "auxiliary loss, say); pipeline stages do not pass such "
                "losses on, and each micro-batch would compute its own. "
                "Train this model without pipeline_parallel (tensor and "
                "data parallelism handle it), or compute that loss from "
                "the model's outputs instead."
            )
    regularized = sum(
        1
        for weight in model.trainable_weights
        if getattr(weight, "regularizer", None) is not None
    )
    if len(model.losses) > regularized:
        raise ValueError(
            f"Model '{model.name}' has losses added by `add_loss` in a "
            "layer's `call` (seen after its last run); pipeline stages do "
            "not pass such losses on. Compute that loss from the model's "
            "outputs instead, before splitting."
        )


def _adds_loss_in_call(layer):
    """Whether the `call` that runs for `layer` calls `add_loss`."""
    for cls in type(layer).__mro__:
        call = cls.__dict__.get("call")
        if call is None:
            continue
        try:
            source = inspect.getsource(call)
        except (OSError, TypeError):
            return False
        return ".add_loss(" in source
    return False


# Building stages -------------------------------------------------------


def _build(graph, positions, balance):
    n = len(graph.nodes)
    spans = _lifetimes(graph)
    bounds = [0] + list(positions) + [n]
    crossings = [_crossing(graph, spans, k) for k in positions]
    boundaries = []
    for index, (k, keys) in enumerate(zip(positions, crossings)):
        tensors = []
        for key in keys:
            info = graph.tensors[key]
            carried = info.producer is None or info.producer < bounds[index]
            tensors.append(
                BoundaryTensor(
                    info.name,
                    _batch_shape(info.tensor.shape),
                    info.tensor.dtype,
                    carried,
                )
            )
        boundaries.append(Boundary(index, tensors))

    stages = []
    for index in range(len(bounds) - 1):
        start, stop = bounds[index], bounds[index + 1]
        nodes = graph.nodes[start:stop]
        taken = {n.operation.name for n in nodes}
        values = {}
        if index == 0:
            flat = []
            for key in graph.inputs:
                tensor = graph.tensors[key].tensor
                symbol = keras.Input(
                    batch_shape=tensor.shape,
                    dtype=tensor.dtype,
                    sparse=getattr(tensor, "sparse", False),
                    name=tensor.name,
                )
                values[key] = symbol
                flat.append(symbol)
            inputs = keras.tree.pack_sequence_as(graph.input_structure, flat)
            input_names = [graph.tensors[key].name for key in graph.inputs]
        else:
            inputs = {}
            for key in crossings[index - 1]:
                info = graph.tensors[key]
                name = info.name
                if name in taken:
                    name = name + "_received"
                symbol = keras.Input(
                    batch_shape=_batch_shape(info.tensor.shape),
                    dtype=info.tensor.dtype,
                    name=name,
                )
                values[key] = symbol
                inputs[name] = symbol
            input_names = list(inputs)
        for node in nodes:
            results = node.replay(values.__getitem__)
            for key, value in zip(node.outputs, results):
                values[key] = value
        if index == len(bounds) - 2:
            flat = [values[key] for key in graph.outputs]
            outputs = keras.tree.pack_sequence_as(graph.output_structure, flat)
            output_names = [graph.tensors[key].name for key in graph.outputs]
        else:
            outputs = {
                graph.tensors[key].name: values[key] for key in crossings[index]
            }
            output_names = list(outputs)
        stage_model = keras.Model(
            inputs=inputs,
            outputs=outputs,
            name=f"{graph.model.name}_stage_{index}",
        )
        layer_names = []
        for node in nodes:
            if node.is_layer and node.operation.name not in layer_names:
                layer_names.append(node.operation.name)
        stages.append(
            Stage(
                index=index,
                model=stage_model,
                layer_names=layer_names,
                operation_names=[node.name for node in nodes],
                input_names=input_names,
                output_names=output_names,
                parameter_count=_count(stage_model.weights),
            )
        )
    cut_points = [graph.nodes[k].name for k in positions]
    return StageSplit(graph.model, stages, boundaries, cut_points, balance)


# Formatting ------------------------------------------------------------


def _batch_shape(shape):
    """`shape` with its first dimension the (unknown) batch.

    Keras infers a batch of 1 where a batch-less tensor is broadcast
    against a batched one (`x + positions` with positions shaped
    `(1, L, D)`); a stage receives whole microbatches.
    """
    shape = tuple(shape)
    return (None,) + shape[1:] if shape else shape


def _count(weights):
    return int(sum(int(np.prod(w.shape)) for w in weights))


def _itemsize(dtype):
    """Bytes per element of a Keras dtype string."""
    if dtype == "bool":
        return 1
    bits = re.search(r"(\d+)", dtype)
    if bits is None:
        raise ValueError(f"Unknown size of dtype {dtype!r}.")
    return int(bits.group(1)) / 8


def _shape_text(shape):
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _bytes_text(tensors, sequence_length):
    """Bytes per sample, as `512` or `512·L` for unknown dimensions."""
    terms = {}
    for t in tensors:
        size = _itemsize(t.dtype)
        unknown = 0
        for dim in t.shape[1:]:
            if dim is None and sequence_length is None:
                unknown += 1
            else:
                size *= int(sequence_length if dim is None else dim)
        terms[unknown] = terms.get(unknown, 0) + size
    parts = []
    for power in sorted(terms, reverse=True):
        value = f"{terms[power]:,.0f}"
        if power == 1:
            value += "·L"
        elif power > 1:
            value += f"·L^{power}"
        parts.append(value)
    return " + ".join(parts)
