"""Errors met with bad inputs name the thing and say what to do.

Backend-neutral: each case runs keras_tp's checks without devices.
Run alone: `python -m pytest tests/test_common_errors.py`.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_tp
from keras_tp.asynchronous.data import as_arrays
from keras_tp.checkpoint.files import MANIFEST
from keras_tp.checkpoint.files import PieceReader
from keras_tp.checkpoint.files import read_manifest
from keras_tp.checkpoint.files import write_pieces
from keras_tp.collectives.sequence import warn_without_sequence_axis
from keras_tp.compiling import check_unbuilt
from tests import models

# The remedy of every damaged or missing checkpoint file.
COPY_AGAIN = "Copy the whole checkpoint directory again"


def _refused(directory, *expected):
    with pytest.raises(keras_tp.CheckpointError) as caught:
        read_manifest(str(directory))
    for text in expected:
        assert text in str(caught.value)


def test_a_missing_checkpoint_directory_is_named(tmp_path):
    missing = tmp_path / "no_such_run"
    _refused(missing, str(missing), "does not exist", "Check the path")


def test_a_file_as_the_checkpoint_directory_is_named(tmp_path):
    file = tmp_path / "model.weights.h5"
    file.write_bytes(b"")
    _refused(file, str(file), "is a file", "Check the path")


def test_a_directory_without_manifest_says_no_save_finished(tmp_path):
    _refused(tmp_path, MANIFEST, "no save into it finished", "from the begin")


@pytest.mark.parametrize(
    "content, what", [("[1, 2]", "JSON list"), ("{not json", "Expecting")]
)
def test_a_damaged_manifest_is_named_with_the_remedy(tmp_path, content, what):
    (tmp_path / MANIFEST).write_text(content)
    _refused(tmp_path, str(tmp_path / MANIFEST), what, COPY_AGAIN)


def test_saving_onto_a_file_is_refused_with_the_fix(tmp_path):
    file = tmp_path / "weights.h5"
    file.write_bytes(b"")
    with pytest.raises(keras_tp.CheckpointError) as caught:
        keras_tp.save_checkpoint(models.mlp(), str(file))
    assert str(file) in str(caught.value)
    assert "Pass another path, or delete the file" in str(caught.value)


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_missing_or_changed_piece_file_is_named(tmp_path, damage):
    name = "save1-cpu0.safetensors"
    entry = write_pieces(str(tmp_path), name, {"w": np.ones(4, "float32")})
    manifest = {"files": {name: entry}}
    variable = {"path": "w", "shape": [4], "dtype": "float32"}
    variable["pieces"] = [{"file": name, "tensor": "w", "index": [[0, 4]]}]
    if damage == "missing":
        os.remove(tmp_path / name)
    else:
        (tmp_path / name).write_bytes(b"x" * entry["bytes"])
    reader = PieceReader(str(tmp_path), manifest)
    with pytest.raises(keras_tp.CheckpointError) as caught:
        reader.read(variable, ((0, 4),))
    assert str(tmp_path / name) in str(caught.value)
    assert COPY_AGAIN in str(caught.value)


def _dataset():
    tf = pytest.importorskip("tensorflow")
    x, y = models.data_for("mlp", batch=8)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


@pytest.mark.parametrize(
    "make", [_dataset, lambda: (row for row in np.ones((4, 2)))]
)
def test_async_fit_refuses_a_dataset_with_the_fix(make):
    with pytest.raises(TypeError) as caught:
        as_arrays(make(), None, None)
    message = str(caught.value)
    assert "takes x as arrays" in message
    assert "as_numpy_iterator" in message


def test_a_built_optimizer_is_refused_unless_it_is_the_models_own():
    optimizer = keras.optimizers.Adam(name="other_adam")
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    with pytest.raises(ValueError) as caught:
        check_unbuilt(optimizer)
    assert "'other_adam' is already built" in str(caught.value)
    assert "keras.optimizers.Adam.from_config(" in str(caught.value)
    check_unbuilt(optimizer, own=optimizer)  # compiled again: its own
    check_unbuilt(keras.optimizers.Adam())
    check_unbuilt("adam")


def test_sequence_parallelism_without_a_sequence_axis_warns():
    with pytest.warns(UserWarning) as caught:
        warn_without_sequence_axis(models.mlp())
    message = str(caught[0].message)
    assert "model 'mlp'" in message and "[(None, 16)]" in message
    assert "pass sequence_parallel=False" in message
    tokens = keras.Input((8,), dtype="int32")
    lm = keras.Model(tokens, keras.layers.Embedding(10, 4)(tokens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_without_sequence_axis(lm)
