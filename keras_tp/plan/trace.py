"""Tracing a model's layer calls: the dataflow graph the planner reads.

The model runs once, eagerly, on a small probe batch with every layer's
`call` instrumented. Each call is recorded in the order it starts, with
its parent (the layer call it runs inside), its input and output tensors,
and their values, which the local-execution check compares against. Raw
tensor ops between layer calls (a residual add, a reshape, a gate multiply)
are not recorded: a tensor no recorded call produced came from such ops.
"""

import collections
import contextlib
import logging
import math

import keras
import numpy as np
from keras import ops

from keras_tp.keras_internals import build_shapes
from keras_tp.keras_internals import calls_layers_for_kernel_reads
from keras_tp.keras_internals import holds_values
from keras_tp.keras_internals import input_structure
from keras_tp.keras_internals import reads_as_matmul
from keras_tp.plan.attention import input_first
from keras_tp.plan.sharding_plan import walk_layers

logger = logging.getLogger(__name__)

# The sizes of a probe batch's unknown dimensions, tried in turn: small
# first; larger where a model's layers need them (a convolution wider
# than 8 samples, a pooling without padding).
PROBE_LENGTHS = (8, 128, 1024)
# The most numbers a larger probe batch may hold (64 MB of float32): where
# several of an input's dimensions are unknown (SAM's masks), 1,024 each
# would not fit.
PROBE_ELEMENTS = 2**24

_CALL_FIELDS = [
    "index",
    "layer",
    "inputs",
    "outputs",
    "parent",
    "result",
    "arguments",
    "argument_values",
    "result_value",
]


class Call(collections.namedtuple("Call", _CALL_FIELDS)):
    """One layer call: its position in start order, the layer, the
    flattened input and output tensors, the index of the call it ran
    inside (`None` at the top), what the call returned, and its `(args,
    kwargs)`. These are the objects the model passed on, for identity (the
    producer of a consumer's input); where tensors change in place (torch's
    `x *= gate` after the call), their values may no longer be the call's.
    `argument_values` and `result_value` are copies taken as the call
    started and as it returned: the values to compare and to run on."""

    @property
    def input_values(self):
        """The values of `inputs`, as the call received them."""
        return flat_tensors(self.argument_values)

    @property
    def output_values(self):
        """The values of `outputs`, as the call returned them."""
        return flat_tensors(self.result_value)

    def arguments_with(self, replaced):
        """`argument_values` with input `i` (of `inputs`) replaced by
        `replaced[i]` where given."""
        positions = iter(range(len(self.inputs)))

        def replace(value):
            if not is_tensor(value):
                return value
            return replaced.get(next(positions), value)

        return keras.tree.map_structure(replace, self.argument_values)


class Trace:
    """The recorded calls of one forward pass, with producer/consumer maps.

    Args:
        calls: the `Call`s in start order.
        inputs: the probe inputs the model ran on.
        outputs: the model's outputs.
    """

    def __init__(self, calls, inputs, outputs):
        self.calls = calls
        self.inputs = inputs
        self.outputs = outputs
        self.producer = {}
        self.consumers = collections.defaultdict(list)
        self.children = collections.defaultdict(list)
        self.calls_of = collections.defaultdict(list)
        for call in calls:
            self.children[call.parent].append(call)
            self.calls_of[id(call.layer)].append(call)
            for tensor in call.inputs:
                self.consumers[id(tensor)].append(call)
        # Calls finish innermost first; the outermost producer of a tensor
        # is the one its consumers outside see, and a layer that returns
        # its input unchanged (Dropout at inference) produces nothing new.
        for call in calls:
            known = {id(t) for t in call.inputs}
            for tensor in call.outputs:
                if id(tensor) not in known:
                    self.producer.setdefault(id(tensor), call)

    def abstract_layers(self):
        """`{id(layer): layer}` of the layers with a call that ran on
        values that do not exist yet: a control-flow op traced it (JAX's
        `ops.cond` traces both branches; `ops.scan` and `ops.while_loop`
        trace their bodies). The planner's checks read and rerun the
        recorded values, which such a call has none of."""
        found = {}
        for call in self.calls:
            values = flat_tensors((call.argument_values, call.result_value))
            if not all(holds_values(value) for value in values):
                found[id(call.layer)] = call.layer
        return found

    def ancestors(self, call):
        """The indices of the calls `call` runs inside, innermost first."""
        chain = []
        parent = call.parent
        while parent is not None:
            chain.append(parent)
            parent = self.calls[parent].parent
        return chain


@contextlib.contextmanager
def instrumented(model, wrap):
    """Replaces the `call` of every sublayer of `model` inside the block
    (each receiving its first call argument by position, `input_first`).

    Args:
        model: the model.
        wrap: function `(layer, call) -> new call`.
    """
    patched = []
    for layer in walk_layers(model):
        patched.append((layer, layer.__dict__.get("call")))
        wrapped = input_first(layer, wrap(layer, layer.call))
        object.__setattr__(layer, "call", wrapped)
    try:
        yield
    finally:
        for layer, previous in patched:
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)


def trace_model(model, inputs=None):
    """Runs `model` once on `inputs` and records every layer call.

    Without `inputs` the model runs on `probe_inputs(model)`, its unknown
    dimensions 8, or larger (`PROBE_LENGTHS`) where the model fails on
    that (a wide audio convolution, a pooling without padding). Where that
    probe's token ids (all ones) feed an embedding, the model runs again on
    random ids below the smallest vocabulary that reads them: on equal
    tokens every position holds the same values, and a split that mixes
    up positions or heads (ALiBi slopes read for the wrong heads) would
    give the one-device numbers on them.

    Args:
        model: a built Keras model.
        inputs: the batch to run; defaults to the probe batch.

    Returns:
        A `Trace`.
    """
    if inputs is not None:
        return _routed(model, inputs)
    trace, shapes = None, []
    for length in PROBE_LENGTHS:
        # The first probe always runs; a larger one only while it is small.
        limit = PROBE_ELEMENTS if shapes else None
        probe = probe_inputs(model, length=length, max_elements=limit)
        if probe is None:
            break
        shapes.append(keras.tree.map_structure(lambda t: tuple(t.shape), probe))
        try:
            trace = _routed(model, probe)
            break
        except Exception as e:  # noqa: BLE001 - a larger probe may run
            error = e
            logger.debug(
                "Model '%s' fails on a probe batch of length %d.",
                model.name,
                length,
                exc_info=True,
            )
    if trace is None:
        error.add_note(
            f"keras_tp traced model '{model.name}' on probe batches made "
            f"from its input shapes, {shapes[-1]}, its unknown dimensions "
            f"each of {PROBE_LENGTHS[: len(shapes)]} in turn. If the model "
            "needs other sizes, pass sample_batch= (a few rows of real "
            "inputs) to TensorParallelKeras or keras_tp.auto_plan."
        )
        raise error
    varied = _random_token_ids(trace)
    if varied is None:
        return trace
    try:
        return _record(model, varied)
    except Exception:  # noqa: BLE001 - the model needs its ids as probed
        logger.debug(
            "Model '%s' fails on random token ids; it is traced on ones.",
            model.name,
            exc_info=True,
        )
        return trace


def _record(model, inputs):
    calls = []
    stack = []

    def wrap(layer, call):
        def recording_call(*args, **kwargs):
            index = len(calls)
            parent = stack[-1] if stack else None
            calls.append(None)
            stack.append(index)
            argument_values = copied((args, kwargs))
            try:
                outputs = call(*args, **kwargs)
            finally:
                stack.pop()
            calls[index] = Call(
                index,
                layer,
                flat_tensors((args, kwargs)),
                flat_tensors(outputs),
                parent,
                outputs,
                (args, kwargs),
                argument_values,
                copied(outputs),
            )
            return outputs

        return recording_call

    with instrumented(model, wrap):
        outputs = model(inputs, training=False)
    # A call that raised leaves no record; nothing else can be missing.
    return Trace([c for c in calls if c is not None], inputs, outputs)


def _routed(model, inputs):
    """`_record`'s trace, once the layers the model ran without calling
    them (a block that multiplies by its sublayers' kernels itself) run
    as calls of the layers, which the planner can split
    (`calls_layers_for_kernel_reads`)."""
    trace = _record(model, inputs)
    uncalled = [
        layer
        for layer in walk_layers(model)
        if not trace.calls_of[id(layer)] and reads_as_matmul(layer)
    ]
    if not uncalled:
        return trace
    calls_layers_for_kernel_reads(uncalled)
    return _record(model, inputs)


def _random_token_ids(trace, seed=1):
    """`trace.inputs` with each integer input that an embedding reads
    replaced by random ids below the smallest `input_dim` reading it, or
    `None` when no embedding reads an input."""
    leaves = keras.tree.flatten(trace.inputs)
    rows = {}
    for call in trace.calls:
        if not isinstance(call.layer, keras.layers.Embedding):
            continue
        for i, leaf in enumerate(leaves):
            if any(t is leaf for t in call.inputs):
                rows[i] = min(
                    rows.get(i, call.layer.input_dim), call.layer.input_dim
                )
    if not rows:
        return None
    rng = np.random.default_rng(seed)
    for i, vocabulary in rows.items():
        ids = rng.integers(0, vocabulary, size=tuple(leaves[i].shape))
        leaves[i] = ops.convert_to_tensor(ids, dtype=leaves[i].dtype)
    return keras.tree.pack_sequence_as(trace.inputs, leaves)


def flat_tensors(structure):
    """The tensors in a nested structure, in order."""
    return [t for t in keras.tree.flatten(structure) if is_tensor(t)]


def copied(structure):
    """`structure` with each backend tensor copied: its values now, which
    an in-place op on the original later leaves as they are."""
    return keras.tree.map_structure(
        lambda value: ops.copy(value) if ops.is_tensor(value) else value,
        structure,
    )


def is_tensor(value):
    return hasattr(value, "shape") and hasattr(value, "dtype")


def probe_inputs(
    model, batch=2, seed=0, length=PROBE_LENGTHS[0], max_elements=None
):
    """A small batch shaped like `model`'s inputs, made in code.

    Float inputs are random normal, so that features differ and a wrong
    split shows in the numbers; integer and boolean inputs (token ids,
    padding masks, segment ids) are ones, valid for any vocabulary
    (`trace_model` then varies the ids an embedding reads).
    Unknown dimensions other than the batch are `length`; `None` where
    the batch would hold more than `max_elements` numbers.
    """
    rng = np.random.default_rng(seed)

    def filled(shape):
        dims = [
            batch if i == 0 and d is None else d for i, d in enumerate(shape)
        ]
        return tuple(length if d is None else int(d) for d in dims)

    def make(shape, dtype):
        dims = filled(shape)
        dtype = keras.backend.standardize_dtype(dtype)
        if keras.backend.is_float_dtype(dtype):
            value = rng.normal(size=dims).astype("float32")
            return ops.convert_to_tensor(value, dtype=dtype)
        return ops.ones(dims, dtype=dtype)

    symbolic = input_structure(model)
    if symbolic is None:
        symbolic = getattr(model, "inputs", None) or None
        if isinstance(model, keras.Sequential) and symbolic:
            symbolic = symbolic[0]  # Sequential takes one tensor, not a list
    shapes = build_shapes(model) if symbolic is None else None
    if shapes and model.built and len(shapes) == 1:
        symbolic = keras.tree.map_shape_structure(
            keras.KerasTensor, next(iter(shapes.values()))
        )
    if symbolic is not None:
        leaves = keras.tree.flatten(symbolic)
        size = sum(math.prod(filled(t.shape)) for t in leaves)
        if max_elements is not None and size > max_elements:
            return None
        return keras.tree.map_structure(
            lambda t: make(t.shape, t.dtype), symbolic
        )
    raise ValueError(
        f"Model '{model.name}' has no known input shape. Build it first: "
        "call `model.build(input_shape)` or run it once on a batch, then "
        "wrap it in TensorParallelKeras."
    )
