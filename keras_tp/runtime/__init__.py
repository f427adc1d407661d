"""Backend runtimes; with `collectives`, the only code that knows backends.

Each backend module defines a `Runtime` subclass named `RUNTIME` and a
`configure_virtual_devices(n)` function; its `pipeline` module defines
`PIPELINE_RUNTIME`: a `keras_tp.pipeline.runtime.PipelineRuntime`
subclass, or a function of the same arguments (`model, config`) that
returns one. `make_runtime` picks between them.
"""

import importlib

import keras

from keras_tp.errors import check_count

_MODULES = {
    "jax": "keras_tp.runtime.jax",
    "torch": "keras_tp.runtime.torch",
    "tensorflow": "keras_tp.runtime.tensorflow",
}


def backend_module():
    """The runtime module of the current Keras backend."""
    backend = keras.backend.backend()
    if backend not in _MODULES:
        raise NotImplementedError(
            f"keras_tp supports the backends {sorted(_MODULES)}, not "
            f"'{backend}'. Set KERAS_BACKEND before importing keras."
        )
    return importlib.import_module(_MODULES[backend])


def make_runtime(model, config):
    """The runtime that runs `model` split as `config` says.

    Args:
        model: the built Keras model; a pipeline cuts it into stages.
        config: a `keras_tp.ParallelConfig` of the current Keras backend.

    Returns:
        The backend's `Runtime`, or its pipeline runtime where
        `config.pipeline_parallel > 1`.
    """
    module = backend_module()
    if config.pipeline_parallel == 1:
        return module.RUNTIME(config)
    pipeline = importlib.import_module(f"{module.__name__}.pipeline")
    return pipeline.PIPELINE_RUNTIME(model, config)


def asynchronous_module():
    """The current backend's `asynchronous` module (`make_runner`)."""
    backend_module()
    return importlib.import_module(
        f"{_MODULES[keras.backend.backend()]}.asynchronous"
    )


def configure_virtual_devices(n):
    """Sets up `n` virtual CPU devices for the current Keras backend.

    Call it right after importing keras_tp, before any Keras operation.
    On JAX it sets `jax_num_cpu_devices`; on TensorFlow it splits the CPU
    into `n` logical devices; on torch, where ranks are processes, it is a
    no-op that logs how to start them (`keras_tp.launch` or `torchrun`).
    If the backend was already initialised with another device count it
    raises an error that says what to do.

    Args:
        n: number of CPU devices to create.
    """
    check_count("n", n)
    return backend_module().configure_virtual_devices(n)
