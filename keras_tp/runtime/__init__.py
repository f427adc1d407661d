"""Backend runtimes; the only place, with `collectives`, that knows backends."""

import keras


def runtime_class():
    """The `Runtime` subclass of the current Keras backend."""
    backend = keras.backend.backend()
    if backend == "jax":
        from keras_tp.runtime.jax import JaxRuntime

        return JaxRuntime
    raise NotImplementedError(
        f"keras_tp does not support the '{backend}' backend yet; use "
        "KERAS_BACKEND=jax."
    )


def configure_virtual_devices(n):
    """Sets up `n` virtual CPU devices for the current Keras backend.

    Call it before any Keras operation. On JAX it sets
    `jax_num_cpu_devices`; if JAX was already initialised with another
    device count it raises an error that says what to do.

    Args:
        n: number of CPU devices to create.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    backend = keras.backend.backend()
    if backend == "jax":
        from keras_tp.runtime.jax import configure_virtual_devices as configure

        return configure(n)
    raise NotImplementedError(
        f"configure_virtual_devices does not support the '{backend}' backend "
        "yet; use KERAS_BACKEND=jax."
    )
