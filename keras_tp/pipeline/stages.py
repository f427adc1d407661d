"""What `split_stages` makes of a model: a `StageSplit` of `Stage`s and
the `Boundary` of each cut (the tensors one stage sends the next)."""

import dataclasses

import keras

from keras_tp import tensors
from keras_tp.pipeline.ownership import WeightOwners


@dataclasses.dataclass(eq=False)
class BoundaryTensor:
    """One tensor sent from a stage to the next.

    Attributes:
        name: its stable name (the producing layer or op, or the model
            input); the receiving stage model's input of that name.
        shape: its shape; the first dimension is the batch, `None`, as
            are other unknown dimensions.
        dtype: its dtype, a string.
        carried: whether the sending stage only passes it on (a skip
            connection, or a model input such as a padding mask).
    """

    name: str
    shape: tuple
    dtype: str
    carried: bool

    def __post_init__(self):
        self.shape = tuple(self.shape)
        self.dtype = keras.backend.standardize_dtype(self.dtype)

    def nbytes(self, batch_size, sequence_length=None):
        """Bytes of this tensor for a batch.

        Args:
            batch_size: the batch (first) dimension, usually a microbatch's.
            sequence_length: the size of every other unknown dimension
                (the sequence axis of a text model).

        Returns:
            An int.

        Raises:
            ValueError: if the tensor has an unknown dimension other than
                the batch and `sequence_length` is not given.
        """
        shape, unknown = self._filled_shape(batch_size, sequence_length)
        if unknown:
            raise ValueError(
                f"Boundary tensor '{self.name}' has shape {self.shape}: "
                "dimensions other than the batch are unknown. Pass "
                "`sequence_length=` (used for each of them), or build "
                "the model on inputs of fixed shape."
            )
        return tensors.nbytes(self, shape)

    def _filled_shape(self, batch_size, sequence_length):
        """`(known dimensions, count of unknown ones)` once filled."""
        filled = [
            dim if dim is not None else sequence_length if i else batch_size
            for i, dim in enumerate(self.shape)
        ]
        known = [dim for dim in filled if dim is not None]
        return known, len(filled) - len(known)


@dataclasses.dataclass(eq=False, repr=False)
class Boundary:
    """A cut: the tensors stage `index` sends to stage `index + 1`.

    Attributes:
        index: the sending stage.
        tensors: the `BoundaryTensor`s: model inputs first, then in the
            order of the nodes that made them.
    """

    index: int
    tensors: list

    @property
    def names(self):
        return [t.name for t in self.tensors]

    def nbytes(self, batch_size, sequence_length=None):
        """Bytes sent across this cut for a batch (see `BoundaryTensor`)."""
        return sum(t.nbytes(batch_size, sequence_length) for t in self.tensors)

    def __repr__(self):
        return f"Boundary({self.index}, {self.names})"


@dataclasses.dataclass(eq=False, repr=False)
class Stage:
    """One stage of a pipeline.

    Attributes:
        model: a Functional model of the user's own layers. Stage 0 takes
            the original model's inputs, a later stage a dict of the tensors
            it receives (`input_names`); each returns a dict of the tensors
            it sends (`output_names`), the last the model's outputs.
        layer_names: the layers called in this stage, in order (those of
            nested models without prefix).
        operation_names: all its nodes, raw ops included (`add`, ...), as
            `cut_points` accepts them.
    """

    index: int
    model: keras.Model
    layer_names: list
    operation_names: list
    input_names: list
    output_names: list
    parameter_count: int

    def __repr__(self):
        return (
            f"<Stage {self.index}: {len(self.layer_names)} layers, "
            f"{self.parameter_count} parameters>"
        )


class StageSplit:
    """A model cut into pipeline stages: what `split_stages` returns.

    Attributes:
        boundaries: the `Boundary` of each cut, `len(stages) - 1` of them.
        cut_points: the first node of each stage after the first;
            `split_stages(model, n, cut_points=split.cut_points)` makes
            the same split.
        balance: what automatic cuts balanced, `None` for user cuts.
        candidate_cut_points: the nodes at which automatic cuts may start
            a stage (where the fewest activations cross), in order.
        shared_weights: `{weight path: [stage indices]}` of the weights
            several stages use (a tied embedding's).
        owners: the `WeightOwners` of the stages' variables.
    """

    def __init__(self, model, stages, boundaries, cut_points, balance):
        self.model = model
        self.stages = stages
        self.boundaries = boundaries
        self.cut_points = cut_points
        self.balance = balance
        self.candidate_cut_points = []
        self.owners = WeightOwners([stage.model for stage in stages], model)

    @property
    def shared_weights(self):
        shared = self.owners.shared_stages
        return {
            v.path: list(shared[id(v)])
            for v in self.model.weights
            if id(v) in shared
        }

    @property
    def num_stages(self):
        return len(self.stages)

    @property
    def parameter_counts(self):
        return [stage.parameter_count for stage in self.stages]

    def bytes_per_cut(self, batch_size, sequence_length=None):
        """Bytes sent across each cut in one forward pass of a batch (the
        backward pass sends as many back, less integer tensors'), a list
        of ints; the arguments are `BoundaryTensor.nbytes`'."""
        return [b.nbytes(batch_size, sequence_length) for b in self.boundaries]

    def run(self, inputs, training=False):
        """The stages run one after the other on one device: the model's
        output, up to float rounding."""
        outputs = inputs
        for stage in self.stages:
            outputs = stage.model(outputs, training=training)
        return outputs

    def summary(self, sequence_length=None):
        """A text table of the stages' layers, parameters and what each
        sends on, with bytes per sample (`512·L` for an unknown dimension
        without `sequence_length`).

        Returns:
            A string.
        """
        total = sum(self.parameter_counts)
        rows = [("stage", "layers", "parameters", "sends", "bytes/sample")]
        for stage in self.stages:
            names = stage.layer_names or stage.operation_names
            if len(names) > 2:
                layers = f"{names[0]} .. {names[-1]} ({len(names)})"
            else:
                layers = ", ".join(names)
            count = stage.parameter_count
            parameters = f"{count:,} ({100 * count / (total or 1):.1f}%)"
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
            f"stages, {total:,} parameters, {how}"
        ]
        lines += [
            "  ".join([*map(str.ljust, row, widths), row[4]]).rstrip()
            for row in rows
        ]
        lines.append("* carried: passed on, not computed, by the stage")
        lines += [
            f"weight {path} is used by stages {using}"
            for path, using in self.shared_weights.items()
        ]
        return "\n".join(lines)

    def __repr__(self):
        return (
            f"<StageSplit of '{self.model.name}': {self.num_stages} stages, "
            f"parameters {self.parameter_counts}>"
        )


def _shape_text(shape):
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _bytes_text(boundary_tensors, sequence_length):
    """Bytes per sample, as `512` or `512·L` for unknown dimensions."""
    terms = {}
    for t in boundary_tensors:
        shape, unknown = t._filled_shape(1, sequence_length)
        terms[unknown] = terms.get(unknown, 0) + tensors.nbytes(t, shape)
    return " + ".join(
        f"{terms[p]:,.0f}" + ("" if p == 0 else "·L" if p == 1 else f"·L^{p}")
        for p in sorted(terms, reverse=True)
    )
