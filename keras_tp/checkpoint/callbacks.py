"""Keras' checkpoint callbacks in a job of several processes.

Every process of a job runs `fit()` and its callbacks, and every process
must call `save_weights`, which writes that process's pieces of the
checkpoint. The callbacks' own file handling assumes a single process:
each process may find the backup directory missing and create it (all but
one then fail), and each would remove it at the end of training. So the
directories are made before training, once every process has arrived,
and only the first process removes a `BackupAndRestore` backup, once
every process has finished writing to it.
"""

import os

import keras


def prepare_callbacks(callbacks, runtime):
    """Makes `BackupAndRestore` and `ModelCheckpoint` safe in every process.

    Args:
        callbacks: the callbacks given to `fit()` (a list, or `None`).
        runtime: the model's runtime (which process this is).
    """
    directories = []
    for callback in callbacks or ():
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            directories.append(callback.backup_dir)
            if not runtime.is_first_process():
                callback.delete_checkpoint = False
            _remove_backup_last(callback, runtime)
        elif isinstance(callback, keras.callbacks.ModelCheckpoint):
            directory = os.path.dirname(str(callback.filepath))
            # A directory named by the epoch or the logs is made per save.
            if directory and "{" not in directory:
                directories.append(directory)
    if not directories:
        return
    for directory in directories:
        os.makedirs(directory, exist_ok=True)
    runtime.wait_for_processes()


def _remove_backup_last(callback, runtime):
    """Makes every process wait for the others at the end of training.

    The first process removes the backup there; a process still writing
    its pieces of the last backup would make the removal fail.
    """
    if getattr(callback, "_keras_tp_waits_at_end", False):
        return
    end = callback.on_train_end

    def on_train_end(logs=None):
        runtime.wait_for_processes()
        end(logs)

    callback.on_train_end = on_train_end
    callback._keras_tp_waits_at_end = True
