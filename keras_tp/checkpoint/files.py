"""The files of a checkpoint: safetensors pieces and a JSON manifest.

A checkpoint directory holds, per save, one safetensors file per writer (a
device, a replica or a rank) with the pieces it holds, and `manifest.json`
naming them with a SHA-256 each. The manifest is written last, by one
process, and replaces the previous one in one `os.replace`: a save killed
at any point leaves the previous manifest and the files it names intact.
"""

import hashlib
import json
import os

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.numpy import save_file

from keras_tp.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "keras_tp.checkpoint"
FORMAT_VERSION = 1
# Bytes read at a time while hashing: one buffer, whatever the file size.
_HASH_CHUNK = 1 << 24
# What to do about a damaged or missing file: the files of a save are only
# valid together, and the previous save's were deleted when it finished.
_REMEDY = (
    "Copy the whole checkpoint directory again from where it was saved, or "
    "load another checkpoint."
)


def write_pieces(directory, name, pieces):
    """Writes one writer's pieces; returns the file's manifest entry.

    The file is written under a temporary name and renamed, so a file with
    its final name is complete.

    Args:
        directory: the checkpoint directory.
        name: the file name, unique to this save and writer.
        pieces: `{tensor name: array}`.

    Returns:
        `{"sha256": ..., "bytes": ...}` of the written file.
    """
    path = os.path.join(directory, name)
    partial = path + ".partial"
    save_file(
        # asarray, not ascontiguousarray, which makes scalars 1-D.
        {key: np.asarray(a, order="C") for key, a in pieces.items()},
        partial,
    )
    entry = {"sha256": file_sha256(partial), "bytes": os.path.getsize(partial)}
    os.replace(partial, path)
    return entry


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory, manifest):
    """Makes `manifest` the checkpoint's, in one atomic replace."""
    path = os.path.join(directory, MANIFEST)
    with open(path + ".partial", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)


def read_manifest(directory):
    """The manifest of the checkpoint in `directory`, checked.

    Raises:
        CheckpointError: if `directory` is not a directory, has no
            manifest, or its manifest is damaged; the message says which
            and what to do.
    """
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(
            f"No checkpoint in '{directory}': the path {what}, and a "
            "checkpoint is a directory. Check the path (relative paths start "
            f"in '{os.getcwd()}')."
        )
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"No checkpoint in '{directory}': it has no {MANIFEST}, so no "
            "save into it finished (a save killed midway leaves none). Check "
            "the path, or start training from the beginning."
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"Checkpoint file '{path}' is damaged: {error}. {_REMEDY}"
        )
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"Checkpoint file '{path}' is damaged: it holds a JSON "
            f"{type(manifest).__name__}, not the manifest's object. {_REMEDY}"
        )
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a keras_tp checkpoint.")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' has format version {manifest['format_version']}; this "
            f"keras_tp reads up to {FORMAT_VERSION}: upgrade keras_tp."
        )
    return manifest


def remove_unlisted(directory, manifest):
    """Deletes piece files of earlier or unfinished saves."""
    listed = set(manifest["files"]) | {MANIFEST}
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name.endswith(".partial"):
            if name not in listed:
                os.remove(os.path.join(directory, name))


class PieceReader:
    """Reads any region of a saved variable from the pieces that cover it.

    Files are opened once, and checked against their SHA-256 before their
    first read, so a damaged file is named before any value is used.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest.
    """

    def __init__(self, directory, manifest):
        self.directory = directory
        self.manifest = manifest
        self._open = {}

    def close(self):
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open = {}

    def _file(self, name):
        if name not in self._open:
            path = os.path.join(self.directory, name)
            expected = self.manifest["files"][name]
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"Checkpoint file '{path}' is missing; the checkpoint in "
                    f"'{self.directory}' cannot be loaded. {_REMEDY}"
                )
            if file_sha256(path) != expected["sha256"]:
                raise CheckpointError(
                    f"Checkpoint file '{path}' is damaged (truncated or "
                    f"changed): its SHA-256 differs from the manifest's. "
                    f"{_REMEDY}"
                )
            try:
                handle = safe_open(path, framework="numpy")
                self._open[name] = handle.__enter__()
            except (SafetensorError, OSError) as error:
                raise CheckpointError(
                    f"Checkpoint file '{path}' is damaged: {error}. {_REMEDY}"
                )
        return self._open[name]

    def read(self, entry, index):
        """The values of region `index` of one saved variable.

        Args:
            entry: the variable's manifest entry.
            index: `((start, stop), ...)` in the full value.

        Returns:
            A NumPy array of the region's shape and the saved dtype.
        """
        shape = tuple(stop - start for start, stop in index)
        out = None
        covered = 0
        for piece in entry["pieces"]:
            overlap = [
                (max(a, c), min(b, d))
                for (a, b), (c, d) in zip(index, piece["index"])
            ]
            if any(start >= stop for start, stop in overlap):
                continue
            source = self._file(piece["file"]).get_slice(piece["tensor"])
            values = source[
                tuple(
                    slice(start - origin, stop - origin)
                    for (start, stop), (origin, _) in zip(
                        overlap, piece["index"]
                    )
                )
            ]
            if out is None:
                out = np.empty(shape, values.dtype)
            out[
                tuple(
                    slice(start - origin, stop - origin)
                    for (start, stop), (origin, _) in zip(overlap, index)
                )
            ] = values
            covered += values.size
        if covered != int(np.prod(shape)):
            raise CheckpointError(
                f"Checkpoint variable '{entry['path']}' does not cover region "
                f"{index} of its shape {entry['shape']}: the checkpoint is "
                f"incomplete. {_REMEDY}"
            )
        if out is None:
            out = np.empty(shape, numpy_dtype(entry["dtype"]))
        return out


def numpy_dtype(name):
    """The NumPy dtype of a Keras dtype name (bfloat16 from ml_dtypes)."""
    return np.dtype(getattr(ml_dtypes, name, name))
