"""In a job of several processes, the first process speaks for the job.

Every process runs `fit()`, `evaluate()` and `predict()`, but only the
first shows Keras' progress bar and writes the logs of `TensorBoard`,
`CSVLogger` and any `ProgbarLogger` given. The other processes run the
remaining callbacks quietly (`verbose=0`): those the whole job needs on
every rank, such as `ModelCheckpoint` and `BackupAndRestore`, which save
each rank's pieces (`keras_tp.checkpoint.callbacks`), and those that
change training, such as `EarlyStopping`, which must stop every rank
alike. The weights every process starts from are the first process's
(`Runtime.equalize_values`), whatever each process was seeded with.

Example:

```python
# On every rank of `torchrun --nproc-per-node 2 train.py`: one progress
# bar and one CSV file, written by rank 0.
tp.fit(x, y, epochs=3, callbacks=[keras.callbacks.CSVLogger("log.csv")])
```
"""

import inspect

import keras

from keras_tp.data_shares import shares_here

# Callbacks that only report: one process writes them for the job.
LOG_WRITERS = (
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
    keras.callbacks.ProgbarLogger,
)


def arguments_here(method, runtime, args, kwargs):
    """The arguments of Keras' `method` for this process of the job.

    Args:
        method: `keras.Model.fit`, `evaluate` or `predict`.
        runtime: the model's runtime (which process this is).
        args: the positional arguments given, after `self`.
        kwargs: the keyword arguments given.

    Returns:
        `(args, kwargs)`: as given on the first process; on the others
        with `verbose=0` and without the callbacks of `LOG_WRITERS`, the
        kept ones made quiet.
    """
    if runtime.is_first_process():
        return args, kwargs
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    bound.arguments["verbose"] = 0
    callbacks = bound.arguments.get("callbacks")
    # A CallbackList comes from `fit()`'s own validation `evaluate()`: the
    # list `fit()` was given here, already without the log writers.
    if callbacks and not isinstance(callbacks, keras.callbacks.CallbackList):
        kept = [c for c in callbacks if not isinstance(c, LOG_WRITERS)]
        for callback in kept:
            if hasattr(callback, "verbose"):
                callback.verbose = 0
        bound.arguments["callbacks"] = kept
    return bound.args[1:], bound.kwargs


class FirstProcessSpeaks:
    """A `keras.Model` mixin: `fit`, `evaluate` and `predict` with the
    arguments of this process (`arguments_here`), and each data-parallel
    row reading its share of the batches (`keras_tp.data_shares`), from
    the runtime `self._runtime`."""

    def fit(self, *args, **kwargs):
        return self._run_here(keras.Model.fit, super().fit, args, kwargs)

    def evaluate(self, *args, **kwargs):
        return self._run_here(
            keras.Model.evaluate, super().evaluate, args, kwargs
        )

    def predict(self, *args, **kwargs):
        return self._run_here(
            keras.Model.predict, super().predict, args, kwargs
        )

    def _run_here(self, method, run, args, kwargs):
        runtime = self._runtime
        args, kwargs, shares = shares_here(method, runtime, args, kwargs)
        args, kwargs = arguments_here(method, runtime, args, kwargs)
        with runtime.reading_shares(shares):
            return run(*args, **kwargs)
