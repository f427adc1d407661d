"""Asynchronous data parallelism: workers, parameter servers, staleness.

`AsyncDataParallel` trains a Keras model with workers that push gradients
to parameter servers without waiting for one another (`model`), under a
bound on how stale an applied gradient may be (`staleness`). The servers
partition the parameters (`servers`); on JAX and TensorFlow workers are
threads on devices of one process (`threads`), on torch processes
(`keras_tp.runtime.torch.asynchronous`).
"""

from keras_tp.asynchronous.model import AsyncDataParallel
from keras_tp.asynchronous.staleness import StalenessBound

__all__ = ["AsyncDataParallel", "StalenessBound"]
