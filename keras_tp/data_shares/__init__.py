"""Each data-parallel row of a job reads only its share of every batch.

The batch that `fit()`, `evaluate()` and `predict()` get is the global
batch, as with Keras' `keras.distribution.distribute_dataset`. Where each
process feeds whole data-parallel rows (a torch rank; a JAX process whose
devices hold rows of the mesh), the input is rebuilt so that row `r` of
`D` reads only the `r`-th `1/D` of each global batch; the tensor-parallel
ranks of a row read the same share, once per process
(`Runtime.data_row`). The steps then take the batch as it comes
(`Runtime.reading_shares`), and the logs and `predict()`'s outputs are
still the global batch's.

What each input becomes:

- `torch.utils.data.DataLoader` (over a map-style dataset, batched): the
  dataset's `__getitem__` runs only for this row's samples; the shuffle
  is the first process's everywhere. For training each batch, the last
  included, must divide by `D`; `predict()` and `evaluate()` read a
  loader whose batches do not divide whole, and pad them.
- `tf.data.Dataset`: in `fit()` each process keeps its row's slice of
  each batch, so only the slice becomes the backend's tensors, but it runs
  the whole pipeline: a `tf.data` batch is read whole. `predict()` and
  `evaluate()` take every batch whole, and pad one that does not divide.
  A shuffled dataset must be seeded alike on every process
  (`shuffle(buffer, seed=...)`), as for Keras' `distribute_dataset`.
- `keras.utils.PyDataset`, an `IterableDataset`, a DataLoader subclass,
  NumPy arrays: every process reads the whole global batch and its steps
  slice it. A `PyDataset`'s `__getitem__` returns a whole batch; giving
  each row whole batches of its own would change which samples make a
  step's batch, so the results would not be one device's. Keras shuffles
  a `PyDataset`'s batches with Python's `random`, which is seeded with the
  first process's seed, so that every process reads the same batches.

Example:

```python
# On each of the 2 processes of keras_tp.launch(train, world_size=2):
loader = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True)
tp = keras_tp.TensorParallelKeras(model, world_size=2, data_parallel=2)
tp.compile(optimizer="adam", loss="mse")
tp.fit(loader, epochs=3)  # each process reads 32 samples of each batch
```
"""

import inspect
import logging
import random

import keras

logger = logging.getLogger(__name__)

# The arguments of each method that carry batches.
_BATCH_ARGUMENTS = {"fit": ("x", "validation_data")}


def shares_here(method, runtime, args, kwargs):
    """The arguments of Keras' `method`, with this process's shares.

    Args:
        method: `keras.Model.fit`, `evaluate` or `predict`.
        runtime: the model's runtime (`Runtime.data_row`).
        args: the positional arguments given, after `self`.
        kwargs: the keyword arguments given.

    Returns:
        `(args, kwargs, shares)`: the arguments, where this process feeds
        one data-parallel row with each input that can be read by shares
        replaced by its row's share; `shares` says whether `x`'s batches
        are this row's shares (for `Runtime.reading_shares`).
    """
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    shares = False
    training = method.__name__ == "fit"
    for name in _BATCH_ARGUMENTS.get(method.__name__, ("x",)):
        data = bound.arguments.get(name)
        shared = share_of(runtime, data, training and name == "x")
        if shared is not None:
            bound.arguments[name] = shared
            shares = shares or name == "x"
    return bound.args[1:], bound.kwargs, shares


def share_of(runtime, data, training):
    """`data`'s share for this process's data-parallel rows, or `None`
    where the process reads it whole.

    Args:
        runtime: the model's runtime (`Runtime.data_row`).
        data: the input, of any kind Keras takes.
        training: whether `fit()` trains on it.

    A `tf.data.Dataset` is shared for training only: it is read whole
    either way. A `PyDataset` is read whole, in the same order on every
    process.
    """
    place = runtime.data_row()
    if place is None:
        return None
    row, rows = place
    if _is_instance(data, "torch.utils.data.dataloader", "DataLoader"):
        from keras_tp.data_shares import torch_loaders

        shared, reason = torch_loaders.loader_share(
            data,
            row,
            rows,
            training,
            lambda seed: runtime.gather_objects(seed)[0],
        )
        if shared is not None:
            return shared
        _log_whole_batches(reason)
    elif _is_instance(data, "tensorflow.python.data.ops", "DatasetV2"):
        from keras_tp.data_shares import tf_datasets

        if tf_datasets.is_shared(data):
            return data
        if training:
            return tf_datasets.shared_dataset(data, row, rows)
    elif isinstance(data, keras.utils.PyDataset):
        # Keras shuffles a PyDataset's batches with Python's `random`:
        # every process draws the first process's order.
        random.seed(runtime.gather_objects(random.getrandbits(62))[0])
        _log_whole_batches("a PyDataset returns whole batches")
    return None


def _log_whole_batches(reason):
    logger.info(
        "Every process reads the whole global batch (%s); each "
        "data-parallel row trains on its slice of it.",
        reason,
    )


def _is_instance(data, module, name):
    """Whether `data` is an instance of class `name` of `module` (a prefix),
    without importing the library that defines it."""
    return any(
        cls.__module__.startswith(module) and cls.__name__ == name
        for cls in type(data).__mro__
    )
