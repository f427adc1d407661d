"""Every use of Keras internals, in one place.

keras_tp reaches below Keras' public API where it must: a rank holds
slices of variables that Keras believes whole, and a split layer runs
inside Keras' own call machinery. This is the only module that imports
`keras.src` or reads private Keras attributes, so a Keras upgrade is
audited here.

A rank holds slices of many variables: its tensor-parallel shard, and under
ZeRO its partition along the data axis. Keras code (a layer's `call`, an
optimizer's `apply`) reads `variable.value` and writes `variable.assign`;
`bind_values` makes those reads and writes go to the given per-rank values
without touching the variables' storage, and makes `variable.shape` agree
with them, as Keras checks shapes on every assign.
"""

import contextlib

from keras import ops
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.utils.io_utils import print_msg

__all__ = [
    "StatelessScope",
    "get_keras_mask",
    "get_stateless_scope",
    "print_msg",
    "set_keras_mask",
]


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


# Layers ----------------------------------------------------------------


def own_variables(layer):
    """Variables tracked on `layer` itself, not through its sublayers."""
    return layer._trainable_variables + layer._non_trainable_variables


def own_trainable_variables(layer):
    return list(layer._trainable_variables)


def sublayers(layer, recursive=True):
    """The layers tracked inside `layer`, without `layer` itself."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def own_seed_generators(layer):
    """The `SeedGenerator`s tracked on `layer` itself (a Dropout's)."""
    return list(layer._seed_generators)


def seed_generators(layer):
    """The `SeedGenerator`s of `layer` and of every layer inside it."""
    return [
        generator
        for sub in layer._flatten_layers(include_self=True)
        for generator in sub._seed_generators
    ]


def draw_from_state(generators):
    """Makes Keras' torch backend draw these generators' masks from state.

    On torch, Keras draws the mask of a Dropout made without a `seed` from
    torch's global generator, which is per process, not per rank or per
    layer, and in no checkpoint. A generator with an initial seed draws
    from its own state variable instead, as on JAX and TensorFlow; giving
    each the seed its state started from changes no other behaviour.
    """
    for generator in generators:
        if generator._initial_seed is None:
            state = ops.convert_to_numpy(generator.state.value)
            generator._initial_seed = int(state[0])


@contextlib.contextmanager
def shifted_seed_draws(generators, shift):
    """Inside, each generator's draws are moved to another random stream.

    Keras random ops draw `seed_generator.next()`, a `[seed, counter]`
    pair, and advance the counter. Here a draw returns
    `[seed + shift(), counter]` while the state advances exactly as
    without it, so ranks that shift by their own amount draw independent
    numbers yet keep the same generator state (and checkpoint it alike).

    Args:
        generators: the `SeedGenerator`s whose draws are shifted.
        shift: function returning the shift, a scalar (it may be traced,
            such as a mesh axis index, so it is read at each draw).
    """
    previous = [generator.__dict__.get("next") for generator in generators]
    for generator in generators:
        draw = generator.next

        def shifted_next(ordered=True, draw=draw):
            seed = draw(ordered)
            amount = ops.cast(shift(), seed.dtype)
            return seed + ops.stack([amount, ops.zeros_like(amount)])

        generator.next = shifted_next
    try:
        yield
    finally:
        for generator, draw in zip(generators, previous):
            if draw is None:
                del generator.next
            else:
                generator.next = draw


def stored_kernel(layer, name):
    """The variable behind a kernel property, or `None`.

    With LoRA enabled, Keras' `kernel` property is the merged tensor; the
    variable itself is `_kernel`.
    """
    return getattr(layer, "_" + name, None)


# Variables -------------------------------------------------------------


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


# Optimizers ------------------------------------------------------------


def moving_average(optimizer, variable):
    """The EMA of `variable` kept by `optimizer` (`use_ema=True`)."""
    averages = optimizer._model_variables_moving_average
    return averages[optimizer._get_variable_index(variable)]


def model_variables_of(optimizer):
    """The model variables `optimizer` was built for, in order."""
    return optimizer._trainable_variables


def own_optimizer_variables(optimizer):
    """The variables an optimizer tracks itself, not through an inner one."""
    return optimizer._variables


def backend_free_add_variable_from_reference(optimizer, reference, **kwargs):
    """Keras' backend-independent `add_variable_from_reference`.

    The TensorFlow optimizer colocates each slot with its reference
    variable; this creates the slot wherever the caller's device scope
    says.
    """
    return BaseOptimizer.add_variable_from_reference(
        optimizer, reference, **kwargs
    )


def place_slots_on_creation(optimizer, placed):
    """Calls `placed(slot, reference)` on every slot `optimizer` creates.

    Keras optimizers make their slots (momenta, velocities) through
    `add_variable_from_reference`; each is handed to `placed` as soon as
    it exists, to be split like its reference. The slot is created by the
    optimizer's class at the time (the TensorFlow runtime mixes a class
    in before building).
    """

    def add_placed_variable(reference_variable, *args, **kwargs):
        variable = type(optimizer).add_variable_from_reference(
            optimizer, reference_variable, *args, **kwargs
        )
        placed(variable, reference_variable)
        return variable

    optimizer.add_variable_from_reference = add_placed_variable


# Models ----------------------------------------------------------------


def compute_loss(model, **kwargs):
    """`model.compute_loss`, also when a user's override lacks `training`."""
    return model._compute_loss(**kwargs)


def compile_arguments(model):
    """The arguments by name that a compiled `model` last passed to Keras'
    own `compile`: a keras-hub task's, with its "auto" defaults filled
    in."""
    return dict(model._compile_config.config)


def compiled_loss(model):
    """The loss `compile(loss=...)` made, a function of `(y_true, y_pred)`
    (with an optional sample weight); `None` before compiling."""
    return model._compile_loss


def jax_update_metrics(model, metrics, loss, x, y, y_pred, sample_weight):
    """Keras' JAX trainer's metric update of a step, as values.

    Returns:
        `(logs, new values of model.metrics_variables)`.
    """
    return model._update_metrics_variables(
        metrics, loss, x, y, y_pred, sample_weight
    )


def update_loss_tracker(model, loss, sample_weight):
    """Adds a step's loss to the mean loss `fit()` reports."""
    model._loss_tracker.update_state(loss, sample_weight=sample_weight)


# Functional graphs (`keras_tp.pipeline.graph`) ----------------------


def producer_node(tensor):
    """`(node, tensor_index)` of the call that produced `tensor`, or `None`.

    `None` for a tensor with no recorded history (a constant).
    """
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    node = history.operation._inbound_nodes[history.node_index]
    return node, history.tensor_index


def node_operation(node):
    """The operation (layer or raw op) a node calls."""
    return node.operation


def node_inputs(node):
    """The `KerasTensor`s among a node's call arguments, flattened."""
    return list(node.arguments.keras_tensors)


def node_outputs(node):
    """The `KerasTensor`s a node returned, flattened."""
    return list(node.outputs)


def is_input_node(node):
    """Whether a node is the call of an `InputLayer` (a graph input)."""
    return node.is_input


def node_call_arguments(node):
    """`(args, kwargs)` a node was called with, tensors included."""
    return node.arguments.args, node.arguments.kwargs


def node_filled_arguments(node, values):
    """`(args, kwargs)` of a node with its tensors replaced.

    Args:
        node: the node.
        values: `{id(keras_tensor): value}` for each of the node's input
            tensors.
    """
    return node.arguments.fill_in(values)
