"""What a runtime gives the checkpoint code: the pieces each process holds.

Each process reads and writes only the pieces of each variable its own
ranks hold; a piece that several ranks hold (a replicated weight, a
variable without a ZeRO partition) is written by the first of them. The
`Placement` says where each piece sits in the full value; a backend
runtime says which ranks live in this process and how to read and write
one rank's piece.
"""

import numpy as np


class CheckpointPieces:
    """The checkpoint side of `Runtime` (a mixin of it)."""

    def full_shape(self, variable):
        """The unsplit shape of `variable` (placed or not)."""
        shapes = self.placement.full_shapes
        return shapes.get(id(variable), tuple(variable.shape))

    def local_pieces(self, variable):
        """The pieces of `variable` this process writes in a checkpoint.

        Every number of the full value is listed once over all processes:
        a piece that several ranks hold is written by the lowest of them.

        Returns:
            A list of `(writer, index, array)`: the device or rank holding
            the piece (it names the file), where the piece sits in the full
            value (`((start, stop), ...)`), and its values in NumPy.
        """
        pieces = []
        for position, (writer, model_rank, data_rank) in enumerate(
            self._ranks_here()
        ):
            if self._holds_first_copy(variable, model_rank, data_rank):
                array = self._read_piece(variable, position)
                for local, index in self._piece_runs(
                    variable, model_rank, data_rank
                ):
                    pieces.append((writer, index, array[local]))
        return pieces

    def assign_local_pieces(self, variable, read):
        """Sets each piece of `variable` held here to `read(index)`.

        Args:
            variable: the variable.
            read: function of a piece's index in the full value
                (`((start, stop), ...)`) returning its values in NumPy.
        """
        for position, (_, model_rank, data_rank) in enumerate(
            self._ranks_here()
        ):
            runs = self._piece_runs(variable, model_rank, data_rank)
            if len(runs) == 1:
                value = read(runs[0][1])
            else:
                # Split by blocks: the piece joins a run of each block.
                value = np.concatenate(
                    [read(index) for _, index in runs],
                    self.placement.axes[id(variable)],
                )
            self._write_piece(variable, position, value)

    def _holds_first_copy(self, variable, model_rank, data_rank):
        if self.placement.is_placed(variable):
            return self.placement.holds_first_copy(
                variable, model_rank, data_rank
            )
        return not (model_rank or data_rank)

    def _piece_runs(self, variable, model_rank, data_rank):
        """`Placement.piece_runs`, or the whole of an unplaced variable."""
        if self.placement.is_placed(variable):
            return self.placement.piece_runs(variable, model_rank, data_rank)
        whole = tuple(slice(None) for _ in variable.shape)
        return [(whole, tuple((0, int(size)) for size in variable.shape))]

    def _ranks_here(self):
        """`[(writer, model_rank, data_rank)]` of this process's ranks."""
        raise NotImplementedError

    def _read_piece(self, variable, position):
        """The NumPy value of the piece the `position`-th rank here holds."""
        raise NotImplementedError

    def _write_piece(self, variable, position, value):
        """Assigns the piece the `position`-th rank here holds."""
        raise NotImplementedError

    def checkpoint_optimizer_state(self, optimizer):
        """`[(key, variable)]` of the optimizer state a checkpoint holds,
        where the runtime's optimizers hold it in their own way; `None`:
        the compiled `optimizer`'s variables, in its order."""
        return None

    def process_index(self):
        """This process's index among the job's processes."""
        return 0

    def is_first_process(self):
        """Whether this process writes what one process writes (a manifest)."""
        return self.process_index() == 0

    def wait_for_processes(self):
        """Returns once every process of the job has reached this call."""

    def gather_objects(self, value):
        """Every process's `value` (JSON-like), in process order, where the
        processes send Python objects to one another (torch's process
        group); `None` where they meet through files in a shared
        directory instead (JAX and TensorFlow hosts)."""
        return None

    def equalize_values(self, variables):
        """Gives `variables`, before they are split, the first process's
        values in every process: processes seeded differently start from
        the same weights, as torch DDP's broadcast from rank 0 makes them.
        A job of one process has nothing to do."""

    def build_optimizer(self, model):
        """Builds the compiled optimizer's state, as the first step would."""
        model.optimizer.build(model.trainable_variables)
