"""`AsyncDataParallel`: asynchronous data parallelism with parameter servers."""

import keras

from keras_tp.asynchronous.data import as_arrays
from keras_tp.asynchronous.data import epoch_slices
from keras_tp.asynchronous.workers import combined_non_trainable_values
from keras_tp.errors import check_count


class AsyncDataParallel(keras.Model):
    """Trains `model` with asynchronous workers and parameter servers.

    Each worker computes the gradient of its slice of a batch and pushes
    it to the servers without waiting for the other workers, then pulls
    the parameters back. The servers hold the trainable variables,
    partitioned over `servers` of them, and apply what they receive with
    copies of the optimizer given to `compile()`. No gradient is applied
    more than `max_staleness` updates after the parameters it was computed
    from (see `keras_tp.asynchronous.StalenessBound`): `max_staleness=0`
    is synchronous data parallelism (every update averages one gradient
    of every worker), and a larger bound lets fast workers run ahead of a
    slow one. The next free worker takes the next slice, so a fast worker
    computes more of each epoch than a slow one.

    - **JAX and TensorFlow:** one thread per worker, each computing on
      its own device of this process; each server keeps its parameters
      and optimizer state on a device, after the workers' (or on the
      workers' devices when there are no more).
    - **torch:** one process per worker and per server, started by
      `keras_tp.launch(train_fn, world_size=workers + servers)` or
      `torchrun`; see `keras_tp.runtime.torch.asynchronous`.

    `fit()` takes arrays. It logs the loss of the gradients applied and
    the staleness (`staleness_mean`, `staleness_max`), and its history
    keeps, per epoch, `staleness_histogram`: `{staleness: gradients}`.
    Between epochs, and when `fit()` returns, the model's variables hold
    the servers' parameters, so `evaluate()`, `predict()` and `save()`
    work as on any Keras model; non-trainable state (moving statistics)
    is the workers' mean.

    Args:
        model: the `keras.Model` to train, built.
        workers: the number of workers.
        servers: the number of parameter servers.
        max_staleness: the most updates a gradient may be applied after
            the parameters it was computed from; 0 is synchronous.
        pull_every: a worker pulls the parameters after every
            `pull_every` gradients it pushes, and computes from the
            parameters it holds in between (never more than
            `max_staleness` updates old: the servers wait for it).
        device_ids: devices to use (JAX, TensorFlow), e.g. `["cpu:0",
            "cpu:1", "cpu:2"]`; all by default.

    Example:

    ```python
    trainer = keras_tp.AsyncDataParallel(model, workers=2, servers=1,
                                         max_staleness=4)
    trainer.compile(optimizer="adam", loss="mse")
    history = trainer.fit(x, y, batch_size=32, epochs=3)
    history.history["staleness_histogram"]   # [{0: 31, 1: 60, 2: 5}, ...]
    ```
    """

    def __init__(
        self,
        model,
        workers=2,
        servers=1,
        max_staleness=0,
        pull_every=1,
        device_ids=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        for name, value, least in (
            ("workers", workers, 1),
            ("servers", servers, 1),
            ("max_staleness", max_staleness, 0),
            ("pull_every", pull_every, 1),
        ):
            check_count(f"AsyncDataParallel's {name}", value, least)
            setattr(self, name, value)
        if not isinstance(model, keras.Model):
            raise TypeError(
                "AsyncDataParallel wraps a keras.Model, got "
                f"{type(model).__name__}."
            )
        if not model.built or not model.trainable_variables:
            raise ValueError(
                f"Model '{model.name}' has no trainable variables yet: build "
                "it first (give it an Input, or call it on a batch)."
            )
        self.wrapped_model = model
        self._device_ids = device_ids
        self._runner = None

    def call(self, inputs, training=None):
        return self.wrapped_model(inputs, training=training)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        """Configures training as `keras.Model.compile` does.

        Every server applies its updates with a copy of `optimizer`.
        """
        super().compile(optimizer, *args, **kwargs)
        self._runner = None

    def _make_runner(self):
        from keras_tp.runtime import asynchronous_module

        return asynchronous_module().make_runner(
            self,
            self.workers,
            self.servers,
            self.max_staleness,
            self._device_ids,
            self.pull_every,
        )

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_data=None,
        shuffle=True,
        sample_weight=None,
        initial_epoch=0,
        validation_batch_size=None,
    ):
        """Trains as `keras.Model.fit` does, with asynchronous workers.

        The arguments are those of `keras.Model.fit`, with the data as
        arrays; callbacks see one training step per global batch whose
        samples were applied.

        Args:
            x: the inputs: an array, or a list or dict of arrays.
            y: the targets, alike.
            batch_size: samples per global batch (32 by default); each
                batch is cut into one slice per worker.
            epochs: the epoch to stop before.
            verbose: 0 (silent), 1 or "auto" (progress bar).
            callbacks: Keras callbacks.
            validation_data: `(x_val, y_val)` or `(x_val, y_val,
                sample_weight_val)`, evaluated after each epoch.
            shuffle: whether each epoch takes the samples in a new order.
            sample_weight: weights of the samples.
            initial_epoch: the epoch to start at.
            validation_batch_size: batch size of the validation.

        Returns:
            A `keras.callbacks.History`.
        """
        if not self.compiled:
            raise ValueError(
                "AsyncDataParallel.fit() needs compile() first: "
                "`trainer.compile(optimizer=..., loss=...)`."
            )
        x, y, sample_weight = as_arrays(x, y, sample_weight)
        batch_size = batch_size or 32
        samples = len(keras.tree.flatten(x)[0])
        steps = -(-samples // batch_size)
        if self._runner is None:
            self._runner = self._make_runner()
        runner = self._runner
        runner.load()
        callbacks = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0 and runner.reports_progress,
            model=self,
            verbose=1 if verbose == "auto" else verbose,
            epochs=epochs,
            steps=steps,
        )
        self.stop_training = False
        callbacks.on_train_begin()
        logs = {}
        for epoch in range(initial_epoch, epochs):
            callbacks.on_epoch_begin(epoch)
            order = runner.epoch_order(samples, shuffle)
            before = runner.staleness_histograms()
            logs = self._train_epoch(
                runner,
                epoch_slices(
                    x, y, sample_weight, batch_size, self.workers, order
                ),
                callbacks,
                batch_size,
                samples,
            )
            self._write_back(runner)
            histograms = [
                _difference(after, earlier)
                for after, earlier in zip(runner.staleness_histograms(), before)
            ]
            logs.update(_staleness_logs(histograms))
            if validation_data is not None:
                logs.update(
                    self._validate(
                        validation_data, validation_batch_size or batch_size
                    )
                )
            callbacks.on_epoch_end(epoch, logs)
            self.history.history.setdefault("staleness_histogram", []).append(
                histograms[0]
            )
            if self.stop_training:
                break
        callbacks.on_train_end(logs)
        return self.history

    def _train_epoch(self, runner, slices, callbacks, batch_size, samples):
        steps = -(-samples // batch_size)
        applied = 0
        loss_sum = 0.0
        step = 0
        logs = {}
        for count, loss in runner.run_epoch(slices):
            applied += count
            loss_sum += loss * count
            logs = {"loss": loss_sum / applied}
            # One step per global batch whose samples are all applied.
            while (step + 1) * batch_size <= applied or (
                step + 1 == steps and applied == samples
            ):
                callbacks.on_train_batch_begin(step)
                callbacks.on_train_batch_end(step, logs)
                step += 1
        return logs

    def _write_back(self, runner):
        """Gives the model's variables the servers' and workers' values."""
        for variable, value in zip(
            self.trainable_variables, runner.trainable_values()
        ):
            variable.assign(value)
        for variable, value in zip(
            self.non_trainable_variables,
            combined_non_trainable_values(self, runner.non_trainable_values()),
        ):
            variable.assign(value)

    def _validate(self, validation_data, batch_size):
        x_val, y_val, *rest = validation_data
        results = self.evaluate(
            x_val,
            y_val,
            sample_weight=rest[0] if rest else None,
            batch_size=batch_size,
            verbose=0,
            return_dict=True,
        )
        return {f"val_{name}": value for name, value in results.items()}

    def staleness_histogram(self):
        """`{staleness: gradients applied}` over every `fit()` so far.

        Counted by server 0; each server applies every gradient, and
        counts its own staleness (`max_staleness` bounds each).
        """
        if self._runner is None:
            return {}
        return self._runner.staleness_histograms()[0]


def _difference(after, before):
    counts = {k: after[k] - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(counts.items()) if v}


def _staleness_logs(histograms):
    """Mean staleness (server 0) and the largest any server applied."""
    first = histograms[0]
    total = sum(first.values())
    mean = sum(k * v for k, v in first.items()) / total if total else 0.0
    largest = max((k for h in histograms for k in h), default=0)
    return {"staleness_mean": float(mean), "staleness_max": float(largest)}
