"""Values bound to variables: a rank's shards seen by Keras' own code.

A rank holds slices of many variables: its tensor-parallel shard, and under
ZeRO its partition along the data axis. Keras code (a layer's `call`, an
optimizer's `apply`) reads `variable.value` and writes `variable.assign`;
`bind_values` makes those reads and writes go to the given per-rank values
without touching the variables' storage, and makes `variable.shape` agree
with them, as Keras checks shapes on every assign.
"""

import contextlib

import keras
from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.utils.jax_utils import is_in_jax_tracing_scope
from keras.src.utils.module_utils import tensorflow as lazy_tensorflow

from keras_tp.keras_internals.variables import direct_assign
from keras_tp.keras_internals.variables import set_reported_shape

# Keras' own scope, and the one active now, for code that binds values
# itself; whether Keras is only inferring shapes.
__all__ = ["StatelessScope", "get_stateless_scope", "in_symbolic_scope"]


class _LayeredScope(StatelessScope):
    """A `StatelessScope` that sees through to the scope around it.

    Keras' own scope hides every variable it does not map; this one passes
    reads and writes of unmapped variables on to the enclosing scope, or to
    the variable itself when there is none, so binding a few variables
    leaves the others as they are.
    """

    def __init__(self, pairs):
        super().__init__()
        for variable, value in pairs:
            self.state_mapping[id(variable)] = value
        self._bound = {id(variable): variable for variable, _ in pairs}

    def __enter__(self):
        self.parent = get_stateless_scope()
        # Losses that layers add go to the enclosing scope too (a trainer's
        # step collects them there); Keras drops them in a scope that does
        # not collect.
        self.collect_losses = bool(
            self.parent is not None and self.parent.collect_losses
        )
        return super().__enter__()

    def add_loss(self, loss):
        self.parent.add_loss(loss)

    def add_update(self, update):
        variable, value = update
        if id(variable) in self._bound:
            self.state_mapping[id(variable)] = value
        elif self.parent is not None:
            self.parent.add_update(update)
        else:
            direct_assign(variable, value)

    def get_current_value(self, variable):
        value = self.state_mapping.get(id(variable))
        if value is None and self.parent is not None:
            return self.parent.get_current_value(variable)
        return value


@contextlib.contextmanager
def bind_values(pairs):
    """Reads and writes of the given variables use the given values.

    Args:
        pairs: `[(variable, value)]`; a value may have another shape than
            the variable (a shard), and the variable reports that shape
            inside the block.

    Yields:
        The scope; `scope.get_current_value(variable)` is a bound
        variable's value after the block's assignments.

    Example:

    ```python
    with bind_values([(layer.kernel, local_kernel)]) as scope:
        outputs = layer.call(inputs)
    ```
    """
    pairs = list(pairs)
    shapes = [(variable, variable._shape) for variable, _ in pairs]
    try:
        for variable, value in pairs:
            set_reported_shape(variable, (int(d) for d in value.shape))
        with _LayeredScope(pairs) as scope:
            yield scope
    finally:
        for variable, shape in shapes:
            set_reported_shape(variable, shape)


@contextlib.contextmanager
def local_shapes(variables, shape_of):
    """Makes each variable report `shape_of(variable)` inside the block.

    Keras' stateless steps check every value against its variable's shape;
    a rank's values are shards, so their variables must report shard
    shapes while the step is traced.
    """
    saved = [(variable, variable._shape) for variable in variables]
    try:
        for variable in variables:
            set_reported_shape(variable, shape_of(variable))
        yield
    finally:
        for variable, shape in saved:
            set_reported_shape(variable, shape)


def stateful_cond(pred, true_fn, false_fn, variables):
    """`ops.cond` over functions that assign variables.

    Traced conditionals (JAX, TensorFlow) cannot let assignments escape
    their branches, so each branch runs on the variables' current values
    bound in a scope and returns the new ones, which are assigned after.
    """
    current = [v.value for v in variables]

    def branch(fn):
        def run():
            with bind_values(zip(variables, current)) as scope:
                fn()
                return [scope.get_current_value(v) for v in variables]

        return run

    new = ops.cond(pred, branch(true_fn), branch(false_fn))
    for variable, value in zip(variables, new):
        variable.assign(value)


class ReadWatcher(StatelessScope):
    """Records reads of the `watched` variables (`{id: name}`) in `read`;
    the values stay the variables'."""

    def __init__(self, watched):
        super().__init__()
        self.watched = watched
        self.read = []

    def get_current_value(self, variable):
        if id(variable) in self.watched:
            self.read.append(self.watched[id(variable)])
        return None


def holds_values(value):
    """Whether a tensor holds numbers now, by Keras' own tests: not a
    tracer of a function the backend traces (JAX's `lax.cond` traces both
    branches and `lax.scan` its body, even when called eagerly), not a
    TensorFlow graph tensor, nor a torch "meta" tensor, which only carries
    a shape (Keras infers shapes on the meta device)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return not is_in_jax_tracing_scope(value)
    if backend == "tensorflow":
        return not lazy_tensorflow.is_symbolic_tensor(value)
    # A NumPy array's `device` is the string "cpu".
    return getattr(getattr(value, "device", None), "type", None) != "meta"
