"""What a Keras layer tracks: its own variables, sublayers, seeds."""

import contextlib
import contextvars
import inspect
import weakref

import keras
from keras import ops
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask

# Keras' functions that read and write the mask a layer attaches to its
# output tensor.
__all__ = ["get_keras_mask", "set_keras_mask"]


def own_variables(layer):
    """Variables tracked on `layer` itself, not through its sublayers."""
    return layer._trainable_variables + layer._non_trainable_variables


def own_trainable_variables(layer):
    return list(layer._trainable_variables)


def sublayers(layer, recursive=True):
    """The layers tracked inside `layer`, without `layer` itself."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def adds_loss_in_call(layer):
    """Whether the `call` that runs for `layer` calls `add_loss`."""
    owners = [c for c in type(layer).__mro__ if "call" in c.__dict__]
    call = owners[0].__dict__["call"] if owners else None
    try:
        return ".add_loss(" in inspect.getsource(call)
    except (OSError, TypeError):
        return False


def take_added_losses(layer, count):
    """Removes and returns the losses `add_loss` appended to `layer`'s own
    list after its first `count`; `added_loss_count` gives `count`."""
    added = layer._losses[count:]
    del layer._losses[count:]
    return added


def clear_added_losses(model):
    """Drops the losses `add_loss` recorded in `model`'s last call, which
    hold that call's autograd graph on torch (Keras clears them at the
    next call anyway)."""
    model._clear_losses()


def added_loss_count(layer):
    """The number of losses in `layer`'s own `add_loss` list."""
    return len(layer._losses)


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


# The attribute of an attention layer's output projection; the others
# (query, key, value, gate) are split by heads into columns.
ATTENTION_OUTPUT_PROJECTION = "_output_dense"


def attention_projections(layer):
    """The projections of a `MultiHeadAttention` or `GroupQueryAttention`.

    Args:
        layer: the attention layer, built.

    Returns:
        `{attribute name: EinsumDense}`: query, key, value, the gate when
        the layer has one, any other projection of a subclass made as the
        query's (XLNet's relative position encoding, projected to every
        head), then the output projection (`ATTENTION_OUTPUT_PROJECTION`).
    """
    names = ["_query_dense", "_key_dense", "_value_dense"]
    if getattr(layer, "_use_gate", False):
        names.append("_gate_dense")
    projections = {name: getattr(layer, name) for name in names}
    output = getattr(layer, ATTENTION_OUTPUT_PROJECTION)
    query = layer._query_dense
    known = [*projections.values(), output]
    for sub in sublayers(layer, recursive=False):
        if (
            isinstance(sub, keras.layers.EinsumDense)
            and not any(sub is k for k in known)
            and sub.built
            and sub.equation == query.equation
            and tuple(sub.kernel.shape) == tuple(query.kernel.shape)
        ):
            projections[sub.name] = sub
    projections[ATTENTION_OUTPUT_PROJECTION] = output
    return projections


def batch_moments(layer):
    """A BatchNormalization layer's `(mean, variance)` of a batch, as a
    function of `(inputs, mask)`."""
    return layer._moments


def set_batch_moments(layer, moments):
    """Makes `layer` compute a batch's statistics with `moments`."""
    object.__setattr__(layer, "_moments", moments)


def reduction_axes(layer):
    """The axes a BatchNormalization layer's statistics reduce."""
    return layer._reduction_axes


# `id(kernel)` -> `(weakref of the kernel, weakref of its layer)`: the
# layers whose kernel `keras.ops.matmul` reads as a call of the layer.
_KERNEL_READS = {}
# The layers being called for a kernel read (Keras' own layers multiply
# with `keras.src.ops`, but a subclass may call `keras.ops.matmul`).
_CALLING = contextvars.ContextVar("keras_tp_kernel_reads", default=())
_matmul = keras.ops.matmul


# Keras' own `keras.ops.reshape`, which `reshape_through`'s wrapper calls.
keras_reshape = keras.ops.reshape


def reshape_through(wrapper):
    """Makes `keras.ops.reshape`, as a model's code calls it
    (`ops.reshape`), call `wrapper`, which defers to `keras_reshape`
    outside the calls it serves (`keras_tp.plan.rank_widths`)."""
    keras.ops.reshape = wrapper


def calls_layers_for_kernel_reads(layers):
    """Makes `keras.ops.matmul(x, layer.kernel)` call `layer(x)`, for each
    of `layers`, wherever the model's code multiplies by their kernels
    itself (a block that reads its sublayers' kernels, as Gemma 4's MLP
    does, never calls them): a split layer then runs its split math, and
    the planner sees the calls. Each of `layers` computes exactly that
    product (`reads_as_matmul`)."""
    for layer in layers:
        kernel = layer.kernel
        _KERNEL_READS[id(kernel)] = (weakref.ref(kernel), weakref.ref(layer))
    keras.ops.matmul = _matmul_calling_layers


def reads_as_matmul(layer):
    """Whether `layer(x)` is `ops.matmul(x, layer.kernel)`, with the
    kernel a variable: a `Dense` or an `EinsumDense` that contracts its
    input's last axis with a 2-D kernel, without bias or activation,
    neither quantized nor with LoRA."""
    if getattr(layer, "quantization_mode", None) or getattr(
        layer, "lora_enabled", False
    ):
        return False
    linear = getattr(layer, "activation", None) in (
        None,
        keras.activations.linear,
    )
    if isinstance(layer, keras.layers.Dense):
        return linear and not layer.use_bias
    if not isinstance(layer, keras.layers.EinsumDense) or layer.bias_axes:
        return False
    inputs, _, output = layer.equation.partition("->")
    read, _, kernel = inputs.partition(",")
    return (
        linear
        and len(kernel) == 2
        and read.endswith(kernel[0])
        and output == read[:-1] + kernel[1]
        and kernel[1] not in read
    )


def _matmul_calling_layers(x1, x2):
    """`keras.ops.matmul`, which calls the layer whose kernel `x2` is
    (`calls_layers_for_kernel_reads`) on a batch of concrete `x1`."""
    entry = _KERNEL_READS.get(id(x2))
    layer = entry and entry[0]() is x2 and entry[1]()
    called = (
        layer
        and layer not in _CALLING.get()
        and not isinstance(x1, keras.KerasTensor)
        and len(getattr(x1, "shape", ())) >= 2
    )
    if not called:
        return _matmul(x1, x2)
    token = _CALLING.set(_CALLING.get() + (layer,))
    try:
        return layer(x1)
    finally:
        _CALLING.reset(token)
