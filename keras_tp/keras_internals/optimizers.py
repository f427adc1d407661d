"""Keras optimizers: their slots, their variables, their update hooks."""

import contextlib
import functools

import keras
from keras.src.optimizers.base_optimizer import BaseOptimizer


def moving_average(optimizer, variable):
    """The EMA of `variable` kept by `optimizer` (`use_ema=True`)."""
    averages = optimizer._model_variables_moving_average
    return averages[optimizer._get_variable_index(variable)]


def accumulated_gradient(optimizer, variable):
    """The sum of `variable`'s gradients that `optimizer` accumulates
    (`gradient_accumulation_steps`) until its next update."""
    accumulated = optimizer._accumulated_gradients
    return accumulated[optimizer._get_variable_index(variable)]


def linear_momentum(optimizer):
    """How `optimizer` updates a momentum linearly from the gradient, or
    `None`: `(decay, rate, momenta, frozen)` with `m <- decay m + rate()
    g`; `momenta` and the lists of slots in `frozen` (Adam's second
    moments) are by the optimizer's variable index. Adam and AdamW set
    `m <- beta_1 m + (1 - beta_1) g`, SGD with momentum (not Nesterov's)
    `m <- momentum m - lr g`."""
    if isinstance(optimizer, keras.optimizers.Adam):
        frozen = [optimizer._velocities]
        if optimizer.amsgrad:
            frozen.append(optimizer._velocity_hats)
        beta = optimizer.beta_1
        return beta, lambda: 1 - beta, optimizer._momentums, frozen
    sgd = isinstance(optimizer, keras.optimizers.SGD)
    if sgd and optimizer.momentum and not optimizer.nesterov:
        rate = optimizer._get_current_learning_rate
        return optimizer.momentum, lambda: -rate(), optimizer.momentums, []
    return None


def slot_of(optimizer, slots, variable):
    """`variable`'s entry of one of `optimizer`'s lists of slots."""
    return slots[optimizer._get_variable_index(variable)]


@contextlib.contextmanager
def clipping_by(optimizer, factor):
    """Inside, `optimizer` clips the gradients it applies (at an update,
    the mean of those it accumulated) by multiplying them by `factor`,
    which its caller takes from more gradients than it is given: a
    pipeline's global norm over every stage. `None` leaves its clipping
    as it is."""
    if factor is None:
        yield
        return
    object.__setattr__(
        optimizer,
        "_clip_gradients",
        lambda grads: [g * keras.ops.cast(factor, g.dtype) for g in grads],
    )
    try:
        yield
    finally:
        object.__delattr__(optimizer, "_clip_gradients")


def model_variables_of(optimizer):
    """The model variables `optimizer` was built for, in order."""
    return optimizer._trainable_variables


@contextlib.contextmanager
def updating_only(optimizer, variables, optimizer_variables):
    """Inside, `optimizer.apply` reads and writes only `variables` and
    `optimizer_variables` (their slots, averages and accumulators, and
    the optimizer's own): Keras averages (`use_ema`) every variable the
    optimizer was built for, and its JAX accumulation (`gradient_
    accumulation_steps`) selects every optimizer variable's new value,
    where a pipeline stage's update holds its own stage's only."""
    restricted = {
        "_trainable_variables": list(variables),
        "_variables": list(optimizer_variables),
    }
    if optimizer.use_ema:
        restricted["_model_variables_moving_average"] = [
            moving_average(optimizer, variable) for variable in variables
        ]
    saved = {name: getattr(optimizer, name) for name in restricted}
    # Set past Keras' tracking, which would add the lists' variables to
    # the optimizer's own.
    for name, value in restricted.items():
        object.__setattr__(optimizer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(optimizer, name, value)


def step_counter(optimizer):
    """The variable that counts `optimizer`'s steps, accumulating ones
    too: its `iterations` divides it by `gradient_accumulation_steps`."""
    return optimizer._iterations


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


def weight_decay_excluded(optimizer, variables, former_keys=None):
    """Those of `variables` that `optimizer` excludes from its weight
    decay (`exclude_from_weight_decay`, which `get_config` leaves out),
    by the key it gives them now or by one it gave them before their
    storage changed (`former_keys`: `{key: variable}`)."""
    keys = getattr(optimizer, "_exclude_from_weight_decay", set())
    formerly = {id(v) for k, v in (former_keys or {}).items() if k in keys}
    return [
        v
        for v in variables
        if id(v) in formerly or not optimizer._use_weight_decay(v)
    ]


def exclude_from_weight_decay(optimizer, variables):
    """Excludes `variables` from `optimizer`'s weight decay, keyed as its
    class keys variables now (a class mixed in may key them otherwise),
    built or not; its excluded names stay excluded."""
    optimizer._exclude_from_weight_decay = set(
        map(optimizer._var_key, variables)
    )
    optimizer._exclude_from_weight_decay_cache = {}


@contextlib.contextmanager
def schedule_at_micro_steps(optimizer, steps):
    """Inside, a `LearningRateSchedule` of `optimizer`, which updates once
    per `steps` micro-batches without counting them, gives the rate one
    device's optimizer accumulating `steps` micro-batches gives: Keras
    evaluates it at the micro-batches counted (`_iterations`), so an
    update after `k` others at `k * steps + steps - 1`."""
    schedule = optimizer._learning_rate
    if steps == 1 or not isinstance(
        schedule, keras.optimizers.schedules.LearningRateSchedule
    ):
        yield
        return
    counted = optimizer._iterations * steps + steps - 1
    object.__setattr__(optimizer, "_learning_rate", lambda: schedule(counted))
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_learning_rate", schedule)


def average_weights(optimizer):
    """Keras' weight averages (`use_ema`) after a step that accumulates
    gradients without updating: Keras' `apply` averages after every step,
    and before the `ema_overwrite_frequency`-th update overwrites the
    variables with the averages on each of its steps."""
    variables = model_variables_of(optimizer)
    optimizer._update_model_variables_moving_average(variables)
    if not isinstance(optimizer, UpdatesThroughAssign):
        _overwrite_with_averages(optimizer, variables)


def _overwrite_with_averages(optimizer, variables):
    """Every `ema_overwrite_frequency`-th step, `variables` take their
    averages. Keras assigns them inside a conditional, whose branch cannot
    assign a variable bound to a value (a ZeRO partition); here, every
    step, by selection."""
    frequency = optimizer.ema_overwrite_frequency
    if not frequency:
        return
    overwrites = keras.ops.equal((optimizer.iterations + 1) % frequency, 0)
    for variable in variables:
        average = moving_average(optimizer, variable)
        value = keras.ops.where(overwrites, average.value, variable.value)
        optimizer.assign(variable, value)


class UpdatesThroughAssign:
    """Mixin: an optimizer's private update hooks, each variable on its own.

    Keras' optimizers apply gradients, weight decay and the moving average
    through hooks that a backend may route elsewhere (the TensorFlow
    optimizer through `tf.distribute`'s cross-replica paths, keyed by each
    variable's distributed container). With this mixin every variable is
    updated by the optimizer's own `update_step`, `assign` and
    `assign_sub`, and keyed by identity, so a subclass that overrides
    those methods decides where each update goes. Its class also takes
    `per_variable_update_steps()` as its last base.
    """

    def _update_model_variables_moving_average(self, trainable_variables):
        super()._update_model_variables_moving_average(trainable_variables)
        _overwrite_with_averages(self, trainable_variables)

    def _overwrite_model_variables_with_average_value(
        self, trainable_variables
    ):
        """Done in `_update_model_variables_moving_average`."""

    def _var_key(self, variable):
        # The TensorFlow optimizer keys variables by their distributed
        # container, whose handle exists only inside a replica; this path
        # always passes Keras variables, which are their own key.
        return id(variable)

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            if self._use_weight_decay(variable):
                lr = keras.ops.cast(self.learning_rate, variable.dtype)
                wd = keras.ops.cast(self.weight_decay, variable.dtype)
                # The optimizer's `assign_sub`, as a Keras variable's would
                # compare the local shard's shape with the full shape.
                self.assign_sub(variable, variable * wd * lr)


def untracked_variables(optimizer):
    """The Keras variables `optimizer` holds as its attributes but does not
    list in its `variables` (Nadam's `_u_product`, made in `build` after
    Keras stopped tracking its attributes)."""
    listed = {id(v) for v in optimizer.variables}
    return [
        value
        for value in vars(optimizer).values()
        if isinstance(value, keras.Variable) and id(value) not in listed
    ]


def mix_in(optimizer, subclass, **attributes):
    """Makes `optimizer` an instance of `subclass` of its class (a
    `mixed_class`) holding `attributes`, as Keras mixes `TFOptimizer` into
    its TensorFlow optimizers."""
    object.__setattr__(optimizer, "__class__", subclass)
    for name, value in attributes.items():
        object.__setattr__(optimizer, name, value)


@functools.cache
def mixed_class(mixin, prefix, optimizer_class, *bases):
    """The subclass of `optimizer_class`, then of `bases`, with `mixin`
    first, named `prefix` and `optimizer_class`'s name in `mixin`'s
    module."""
    return type(
        f"{prefix}{optimizer_class.__name__}",
        (mixin, optimizer_class, *bases),
        {"__module__": mixin.__module__},
    )


@functools.cache
def per_variable_update_steps():
    """The backend's optimizer class, its gradients applied one variable at
    a time by `update_step`: the last base of a class with
    `UpdatesThroughAssign`, so that an optimizer's own
    `_backend_update_step` (Nadam's, which advances its `_u_product`
    first) still runs and then reaches this one through `super()`."""
    # `keras.optimizers.Optimizer` derives from the backend's first.
    backend_optimizer = keras.optimizers.Optimizer.__mro__[1]

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for grad, variable in zip(grads, trainable_variables):
            self.update_step(grad, variable, learning_rate)

    return type(
        "PerVariableUpdateSteps",
        (backend_optimizer,),
        {"_backend_update_step": _backend_update_step, "__module__": __name__},
    )
