"""A Keras variable's storage, its reported shape and its JAX layout."""


def set_reported_shape(variable, shape):
    """Makes `variable.shape` report `shape` (Keras checks assigns on it)."""
    variable._shape = tuple(shape)


def stored_value(variable):
    """The backend object a Keras variable stores its value in."""
    return variable._value


def set_stored_value(variable, value):
    variable._value = value


def direct_assign(variable, value):
    """Assigns without Keras' shape check or scope handling."""
    variable._direct_assign(value)


def jax_layout(variable):
    """The sharding a Keras JAX variable re-applies on every assign."""
    return variable._layout


def set_jax_layout(variable, layout):
    variable._layout = layout
