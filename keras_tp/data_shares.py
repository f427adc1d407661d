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

# The arguments of each method that carry batches.
_BATCH_ARGUMENTS = {"fit": ("x", "validation_data")}


def shares_here(method, runtime, args, kwargs):
    """The arguments of Keras' `method`, with this process's shares.

    Args:
        method: `keras.Model.fit`, `evaluate` or `predict`.
        runtime: the model's runtime (`Runtime.data_share`).
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
        shared = runtime.data_share(data, training and name == "x")
        if shared is not None:
            bound.arguments[name] = shared
            shares = shares or name == "x"
    return bound.args[1:], bound.kwargs, shares
