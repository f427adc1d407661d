"""Each data-parallel row of a job reads only its share of every batch.

The batch that `fit()`, `evaluate()` and `predict()` get is the global
batch, as with Keras' `keras.distribution.distribute_dataset`. Where each
process feeds one data-parallel row (torch: one process per rank), the
input is rebuilt so that row `r` of `D` reads only the `r`-th `1/D` of
each global batch; the tensor-parallel ranks of a row read the same share,
once per process. The steps then take the batch as it comes
(`Runtime.reading_shares`), and the logs and `predict()`'s outputs are
still the global batch's.

What each input becomes:

- `torch.utils.data.DataLoader` (over a map-style dataset, batched): the
  dataset's `__getitem__` runs only for this row's samples; the shuffle
  is the first process's everywhere. For training each batch, the last
  included, must divide by `D`; `predict()` and `evaluate()` read a
  loader whose batches do not divide whole, and pad them.
- `tf.data.Dataset`: in `fit()` each process keeps its row's slice of
  each batch, so only the slice becomes torch tensors, but it still runs
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
    place = runtime.data_row()
    if place is None or runtime.backend != "torch":
        return args, kwargs, False
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    shares = False
    training = method.__name__ == "fit"
    for name in _BATCH_ARGUMENTS.get(method.__name__, ("x",)):
        data = bound.arguments.get(name)
        shared = _torch_share(data, place, runtime, training and name == "x")
        if shared is not None:
            bound.arguments[name] = shared
            shares = shares or name == "x"
    return bound.args[1:], bound.kwargs, shares


def _torch_share(data, place, runtime, training):
    """`data`'s share for this process's row on torch, or `None`.

    A DataLoader whose batches do not split over the rows is read whole
    for `predict()` and `evaluate()`, which pad such a batch
    (`keras_tp.runtime.padding`), and refused for training. A
    `tf.data.Dataset` is shared for training only: it is read whole
    either way.
    """
    from keras_tp.runtime.torch import data_shares

    row, rows = place
    if data_shares.is_shared(data):
        return data
    if isinstance(data, data_shares.DataLoader):
        data_shares.check_not_sampled_per_process(data, rows)
        size = data_shares.indivisible_size(data, rows)
        if training and size is not None:
            raise data_shares.indivisible_batch(size, rows)
        reason = data_shares.unshareable_reason(data, rows)
        if reason is None:
            return data_shares.shared_loader(
                data, row, rows, lambda seed: runtime.gather_objects(seed)[0]
            )
        _log_whole_batches(reason)
    elif _is_tf_dataset(data) and training:
        return data_shares.shared_tf_dataset(data, row, rows)
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


def _is_tf_dataset(data):
    return any(
        cls.__module__.startswith("tensorflow.python.data.ops")
        and cls.__name__ == "DatasetV2"
        for cls in type(data).__mro__
    )
