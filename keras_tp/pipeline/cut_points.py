"""Where a pipeline's cuts may fall, and which `split_stages` takes: by the
activations crossing each position of a model's dataflow graph and each
node's parameters, or by name."""

import difflib
import logging

import numpy as np

logger = logging.getLogger(__name__)


def parameter_sizes(graph):
    """The weight scalars of each node, a weight counted at its first use
    only (a tied embedding's at the token lookup)."""
    seen, sizes = set(), []
    for node in graph.nodes:
        weights = getattr(node.operation, "weights", ())
        new = [w for w in weights if id(w) not in seen]
        seen.update(map(id, new))
        sizes.append(sum(int(np.prod(w.shape)) for w in new))
    return sizes


def candidate_cuts(graph):
    """`(candidates, fewest)`: the cuts where the fewest activations
    cross, and that number. Model inputs and early outputs, which cross
    many cuts alike, are not counted."""
    allowed = range(1, len(graph.nodes))
    counts = np.zeros(len(graph.nodes) + 1, dtype=np.int64)
    outputs = set(graph.outputs)
    for key, info in graph.tensors.items():
        if info.producer is not None:
            last = info.first if key in outputs else info.last
            counts[info.first : last + 1] += 1
    fewest = min((counts[k] for k in allowed), default=None)
    return [k for k in allowed if counts[k] == fewest], fewest


def automatic_cuts(graph, num_stages, sizes, found):
    n = len(graph.nodes)
    if num_stages == 1:
        return []
    candidates, fewest = found
    if not candidates:
        raise ValueError(
            f"Model '{graph.model.name}' has {n} node(s) and cannot be cut "
            f"into {num_stages} stages."
        )
    if num_stages > len(candidates) + 1:
        where = ", ".join(f"'{graph.nodes[k].name}'" for k in candidates[:12])
        more = " ..." if len(candidates) > 12 else ""
        raise ValueError(
            f"Model '{graph.model.name}' has {len(candidates)} candidate "
            f"cut point(s), where {fewest} activation(s) cross (new stages "
            f"could start at {where}{more}), so at most "
            f"{len(candidates) + 1} stages; got num_stages={num_stages}. "
            "Use fewer stages, or pass `cut_points=` (names of the layers "
            "at which stages start)."
        )
    # No parameters at all: balance node counts.
    weights = sizes if sum(sizes) else [1] * n
    cuts = _balanced(weights, candidates, num_stages)
    logger.info(
        "Cut '%s' at %s among %d candidates.",
        graph.model.name,
        [graph.nodes[k].name for k in cuts],
        len(candidates),
    )
    return cuts


def _balanced(weights, candidates, num_stages):
    """The cuts among `candidates` that make the largest stage smallest,
    then the sum of squared stage weights smallest. Among equal choices a
    later cut wins, so parameterless layers stay with the one before."""
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
            for j in range(s, m) if s < num_stages else [m - 1]:
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


def user_cuts(graph, num_stages, cut_points):
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
    for i, (name, k) in enumerate(zip(cut_points, positions)):
        if k == 0:
            raise ValueError(
                f"Cut point '{name}' is the first node of model "
                f"'{graph.model.name}': stage 0 would be empty. Name the "
                "layer at which the *second* stage starts."
            )
        if i and k <= positions[i - 1]:
            before, previous = cut_points[i - 1], positions[i - 1]
            raise ValueError(
                f"Cut point '{name}' (node {k}) does not come after "
                f"'{before}' (node {previous}) in the order model "
                f"'{graph.model.name}' runs its layers. List cut points in "
                "that order, each once; `split.stages[i].operation_names` "
                "shows it."
            )
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
        names = [x for n in graph.nodes for x in (n.name, n.operation.name)]
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
