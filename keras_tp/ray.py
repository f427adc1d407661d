"""Ray Train: keras_tp's ranks as the workers of a Ray trainer.

`ray.train.torch.TorchTrainer` starts one worker process per rank and
joins them in a torch process group; `TensorParallelKeras` adopts that
group as it adopts torchrun's, so a training function that builds and
fits a `TensorParallelKeras` runs unchanged in it.
`ray.train.tensorflow.TensorflowTrainer` sets each worker's `TF_CONFIG`:
there the function calls `configure_multi_worker()` first. Under
`ray.train.v2.jax.JaxTrainer` it calls `keras_tp.initialize_distributed()`
first, which starts `jax.distributed` over CPU workers (on GPUs and TPUs
Ray has done it).
`ReportCheckpoint` reports each epoch's metrics and sharded checkpoint to
Ray, and resumes from Ray's latest checkpoint: after
`FailureConfig(max_failures=...)` restarts the workers, or when a new
trainer is given `resume_from_checkpoint=`.

Example:

```python
import ray.train
from ray.train.torch import TorchTrainer

def train_fn(config):
    world_size = ray.train.get_context().get_world_size()
    tp = keras_tp.TensorParallelKeras(build_model(), world_size=world_size)
    tp.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tp.fit(x, y, epochs=config["epochs"],
           callbacks=[keras_tp.ray.ReportCheckpoint()])

trainer = TorchTrainer(
    train_fn,
    train_loop_config={"epochs": 4},
    scaling_config=ray.train.ScalingConfig(num_workers=2),
    run_config=ray.train.RunConfig(
        failure_config=ray.train.FailureConfig(max_failures=2)
    ),
)
result = trainer.fit()
```
"""

import importlib
import tempfile

import keras

from keras_tp.checkpoint import load_checkpoint
from keras_tp.checkpoint import save_checkpoint
from keras_tp.keras_internals import set_initial_epoch


def _ray_train():
    """`ray.train`, imported when first used: `keras_tp.ray` itself
    imports without Ray."""
    try:
        return importlib.import_module("ray.train")
    except ImportError as error:
        raise ImportError(
            "keras_tp.ray.ReportCheckpoint needs Ray Train: pip install "
            "'keras_tp[ray]' (or 'ray[train]')."
        ) from error


class ReportCheckpoint(keras.callbacks.Callback):
    """Reports metrics and a sharded checkpoint to Ray Train every epoch.

    Every worker saves the pieces of the model and optimizer state its
    ranks hold into a local directory, and the first writes the manifest;
    Ray merges the workers' directories into one checkpoint, which any
    layout and backend loads (`keras_tp.load_checkpoint`). The metrics
    Ray records are the first worker's logs of the epoch.

    At the start of `fit()`, if Ray holds a checkpoint of this run (after
    a restart) or was given one to resume from, the model and optimizer
    state are loaded from it and training continues at the epoch after
    it, as Keras' `BackupAndRestore` continues.

    Args:
        frequency: report every this many epochs (the last epoch of
            `fit()` is always reported).
        checkpoint: whether to attach the checkpoint; `False` reports
            metrics only.
    """

    def __init__(self, frequency=1, checkpoint=True):
        super().__init__()
        if not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f"ReportCheckpoint(frequency={frequency!r}): pass a positive "
                "number of epochs."
            )
        self.frequency = frequency
        self.checkpoint = checkpoint
        self.resumed_epoch = None
        self._train = _ray_train()

    def on_train_begin(self, logs=None):
        checkpoint = self._train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            info = load_checkpoint(self.model, directory)
        if info["epoch"] is not None:
            self.resumed_epoch = info["epoch"]
            set_initial_epoch(self.model, info["epoch"])

    def on_epoch_end(self, epoch, logs=None):
        last = epoch + 1 == self.params.get("epochs")
        if (epoch + 1) % self.frequency and not last:
            return
        # Keras' CallbackList has made the logs Python numbers already.
        metrics = dict(logs or {})
        metrics["epoch"] = epoch + 1
        if not self.checkpoint:
            self._train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as directory:
            save_checkpoint(self.model, directory, epoch=epoch + 1)
            self._train.report(
                metrics,
                checkpoint=self._train.Checkpoint.from_directory(directory),
            )
