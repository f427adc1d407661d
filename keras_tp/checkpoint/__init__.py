"""Sharded checkpoints that load at any layout, on any backend.

`save_checkpoint` has every process write the pieces its devices hold, in
parallel, to safetensors files; no process gathers a full variable. The
manifest says where each piece sits in its variable's full value, so
`load_checkpoint` reads, for each rank of the model it loads into, exactly
the region that rank holds, whatever the saving layout was: another
tensor-parallel size, data-parallel size or ZeRO stage, another backend,
or a plain Keras model on one device.

What a checkpoint holds: the model's variables (weights, BatchNorm
statistics, dropout seed states), the optimizer's state (slots, iteration
count, the gradients a `CoordinatedOptimizer` is accumulating), the epoch,
and Python's and NumPy's random states. See `docs/guides/checkpoints.md`.
"""

import concurrent.futures
import json
import os
import random

import keras
import numpy as np

from keras_tp.checkpoint.files import FORMAT
from keras_tp.checkpoint.files import FORMAT_VERSION
from keras_tp.checkpoint.files import MANIFEST
from keras_tp.checkpoint.files import PieceReader
from keras_tp.checkpoint.files import numpy_dtype
from keras_tp.checkpoint.files import read_manifest
from keras_tp.checkpoint.files import remove_unlisted
from keras_tp.checkpoint.files import write_manifest
from keras_tp.checkpoint.files import write_pieces
from keras_tp.checkpoint.state import checkpoint_state
from keras_tp.checkpoint.state import storage_of
from keras_tp.errors import CheckpointError

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(model, directory, epoch=None):
    """Saves `model`'s variables and optimizer state to `directory`.

    Every process writes the pieces its devices hold, each device's into
    a file of its own, in parallel; one process then writes the manifest.
    The previous checkpoint in `directory` stays valid until the new
    manifest replaces it in one rename.

    Args:
        model: a `TensorParallelKeras`, or a plain `keras.Model`.
        directory: the checkpoint directory (created if needed).
        epoch: the number of epochs done, recorded for resuming `fit()`.

    Returns:
        The manifest, as a dict.

    Raises:
        CheckpointError: if `directory` is a file.

    Example:

    ```python
    tp.fit(x, y, epochs=2)
    keras_tp.save_checkpoint(tp, "ckpt", epoch=2)
    # later, at any layout, on any backend:
    info = keras_tp.load_checkpoint(tp2, "ckpt")
    tp2.fit(x, y, initial_epoch=info["epoch"], epochs=4)
    ```
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(
            f"Cannot save a checkpoint to '{directory}': it is a file, and a "
            "checkpoint is a directory of files. Pass another path, or "
            "delete the file first."
        )
    storage = storage_of(model)
    state = checkpoint_state(model)
    os.makedirs(directory, exist_ok=True)
    save = _next_save_number(directory)
    by_writer = {}
    entries = []
    for key, variable in state:
        pieces = []
        for writer, index, array in storage.local_pieces(variable):
            tensor = f"{key}@{'_'.join(f'{a}-{b}' for a, b in index)}"
            by_writer.setdefault(writer, {})[tensor] = array
            pieces.append((writer, {"tensor": tensor, "index": index}))
        entries.append((key, variable, pieces))
    files = _write_in_parallel(directory, save, by_writer)
    sidecar = {
        "files": files,
        "pieces": {
            key: [
                {"file": _file_name(save, writer), **piece}
                for writer, piece in pieces
            ]
            for key, _, pieces in entries
        },
    }
    # Processes that can send one another objects (torch's) need no
    # shared directory: each may save into a local one of its own, and
    # only the first holds the manifest (as Ray Train merges them).
    sidecars = storage.gather_objects(sidecar)
    if sidecars is None:
        _write_json(
            os.path.join(directory, _sidecar_name(save, storage)), sidecar
        )
        storage.wait_for_processes()
    manifest = None
    if storage.is_first_process():
        manifest = _manifest(
            model,
            storage,
            state,
            sidecars or _read_sidecars(directory, save),
            save,
            epoch,
        )
        write_manifest(directory, manifest)
        remove_unlisted(directory, manifest)
        for name in os.listdir(directory):
            if name.startswith(f"save{save}-") and name.endswith(".json"):
                os.remove(os.path.join(directory, name))
    shared = storage.gather_objects(manifest)
    if shared is not None:
        return shared[0]
    storage.wait_for_processes()
    return read_manifest(directory)


def load_checkpoint(model, directory):
    """Loads a checkpoint into `model`, at `model`'s own layout.

    Each process reads only the regions its devices hold. The optimizer
    state is loaded when `model` is compiled (its optimizer is built first
    if needed); loading continues training as if uninterrupted.

    Args:
        model: a `TensorParallelKeras`, or a plain `keras.Model`.
        directory: a directory written by `save_checkpoint`.

    Returns:
        A dict with the checkpoint's `epoch`, `step`, `backend` and `mesh`.

    Raises:
        CheckpointError: if the checkpoint is missing or damaged (the
            message names the file), or does not fit `model` (it names the
            variable).
    """
    manifest = read_manifest(directory)
    storage = storage_of(model)
    saved = {entry["key"]: entry for entry in manifest["variables"]}
    state = checkpoint_state(model, build_optimizer=_has_optimizer(saved))
    _check_fit(state, saved, manifest, storage)
    reader = PieceReader(directory, manifest)
    try:
        for variable, entry in _saved_entries(state, saved):
            dtype = numpy_dtype(keras.backend.standardize_dtype(variable.dtype))
            storage.assign_local_pieces(
                variable,
                lambda index, entry=entry: reader.read(entry, index).astype(
                    dtype, copy=False
                ),
            )
    finally:
        reader.close()
    _restore_random_states(manifest["random"])
    return {
        "epoch": manifest["epoch"],
        "step": manifest["step"],
        "backend": manifest["backend"],
        "mesh": manifest["mesh"],
    }


def _saved_entries(state, saved):
    """`(variable, manifest entry)` of each variable `saved` holds."""
    return [(variable, saved[key]) for key, variable in state if key in saved]


def _has_optimizer(saved):
    return any(key.startswith("optimizer/") for key in saved)


def _check_fit(state, saved, manifest, storage):
    """Refuses a checkpoint of another model, naming what differs."""
    keys = {key for key, _ in state}
    mine = [k for k in keys if k.startswith("model/")]
    theirs = [k for k in saved if k.startswith("model/")]
    if len(mine) != len(theirs):
        raise CheckpointError(
            f"The checkpoint has {len(theirs)} model variables, the model "
            f"{len(mine)}: it was saved from another architecture."
        )
    mine = [k for k in keys if k.startswith("optimizer/")]
    theirs = [k for k in saved if k.startswith("optimizer/")]
    if mine and len(mine) != len(theirs):
        raise CheckpointError(
            f"The checkpoint's optimizer state ({manifest['optimizer']}) has "
            f"{len(theirs)} variables, this model's optimizer {len(mine)}: "
            "compile with the optimizer the checkpoint was saved with, or "
            "load the weights alone into an uncompiled model."
        )
    for variable, entry in _saved_entries(state, saved):
        shape = list(storage.full_shape(variable))
        if shape != entry["shape"]:
            raise CheckpointError(
                f"Variable '{variable.path}' has shape {tuple(shape)}, but "
                f"the checkpoint's '{entry['path']}' has "
                f"{tuple(entry['shape'])}: it was saved from another "
                "architecture."
            )


def _next_save_number(directory):
    """One more than the last finished save in `directory`.

    Every process reads the same manifest here: the new one is written
    only after every process has written its files.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return 1
    try:
        return read_manifest(directory)["save"] + 1
    except CheckpointError:
        # A damaged manifest is replaced; its number does not matter.
        return 1


def _file_name(save, writer):
    return f"save{save}-{writer}.safetensors"


def _sidecar_name(save, storage):
    return f"save{save}-process{storage.process_index()}.json"


def _write_in_parallel(directory, save, by_writer):
    """Writes each writer's file in a thread of its own."""
    if not by_writer:
        return {}
    with concurrent.futures.ThreadPoolExecutor(len(by_writer)) as pool:
        futures = {
            _file_name(save, writer): pool.submit(
                write_pieces, directory, _file_name(save, writer), pieces
            )
            for writer, pieces in by_writer.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _write_json(path, content):
    with open(path + ".partial", "w") as f:
        json.dump(content, f)
    os.replace(path + ".partial", path)


def _read_sidecars(directory, save):
    """Every process's sidecar of save number `save`, from its file."""
    sidecars = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(f"save{save}-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                sidecars.append(json.load(f))
    return sidecars


def _manifest(model, storage, state, sidecars, save, epoch):
    """The manifest, from every process's sidecar of this save."""
    files = {}
    pieces = {}
    for sidecar in sidecars:
        files.update(sidecar["files"])
        for key, listed in sidecar["pieces"].items():
            pieces.setdefault(key, []).extend(listed)
    variables = []
    for key, variable in state:
        shape = [int(d) for d in storage.full_shape(variable)]
        entry = {
            "key": key,
            "path": variable.path,
            "shape": shape,
            "dtype": keras.backend.standardize_dtype(variable.dtype),
            "pieces": pieces.get(key, []),
        }
        _check_covered(entry)
        variables.append(entry)
    optimizer = getattr(model, "optimizer", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "keras_tp_version": _version(),
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "save": save,
        "step": _step(optimizer),
        "epoch": epoch,
        "mesh": storage.mesh_description(),
        "plan": storage.plan_description(),
        "optimizer": type(optimizer).__name__ if optimizer else None,
        "random": _random_states(),
        "variables": variables,
        "files": files,
    }


def _check_covered(entry):
    """Every number of a variable is saved exactly once."""
    size = sum(
        int(np.prod([b - a for a, b in p["index"]])) for p in entry["pieces"]
    )
    if size != int(np.prod(entry["shape"])):
        raise CheckpointError(
            f"Saving variable '{entry['path']}' wrote {size} numbers of "
            f"{int(np.prod(entry['shape']))}: did every process call "
            "save_checkpoint()?"
        )


def _step(optimizer):
    if optimizer is None or not optimizer.built:
        return 0
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _version():
    from keras_tp import __version__

    return __version__


def _random_states():
    """Python's and NumPy's global random states, as JSON."""
    name, keys, position, has_gauss, cached_gauss = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "numpy": [
            name,
            keys.tolist(),
            int(position),
            int(has_gauss),
            float(cached_gauss),
        ],
        "python": [version, list(internal), gauss],
    }


def _restore_random_states(states):
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), *rest))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
