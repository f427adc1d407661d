"""Sequence shards on TensorFlow: a tensor whose shape is the whole sequence's.

Each replica of a `tf.distribute` strategy runs the model's whole code on
its own tensors. Under sequence parallelism the activations between the
regions are sequence shards, but that code reads shapes from them:
keras-hub's decoders build their causal masks from the hidden states'
length, and a position embedding takes as many rows. TensorFlow has no
`DTensor` for replicas, so a shard travels as a `SequenceShard`, an
extension type that plays its part: its `shape` is the whole sequence's,
it holds this rank's slice of the sequence axis (axis 1) over the `model`
ranks, and TensorFlow's type-based dispatch runs an operation on it as
follows.

- Pointwise operations (TensorFlow's unary and binary elementwise APIs:
  the norms' arithmetic, activations, residual adds) and reductions over
  the feature axes run on the slice alone, and their result is a shard.
- A whole tensor that meets a shard in a binary operation is sliced to
  the rank's positions where it has the sequence axis (a position table, a
  dropout's mask), or broadcast as it is (a norm's scale); its gradient,
  each rank's partial sum, is made whole by one counted collective in the
  backward pass (an all-gather, or an all-reduce: Megatron's all-reduce of
  its sequence-parallel weights' gradients).
- `tf.shape` gives the whole sequence's shape, and dropout draws the whole
  sequence's mask from its seed and keeps the rank's slice: one device's
  masks.
- Any other operation (a pooling over the sequence, a reshape, the
  attention of a layer the plan keeps whole) converts the shard to a
  tensor (`__tf_tensor__`), which all-gathers it, counted; its gradient,
  the same on every rank, is sliced back.

The collectives are those of the `model`-axis adapter of the replica step
that made the shards (`shards_of`).

The types and their context are `keras_tp.collectives.tensorflow_shards`;
this module holds the dispatch rules, which importing it registers, and
hands the types on: code that makes or reads shards imports them from here,
so that the rules are in place wherever a shard is.
"""

import typing

import tensorflow as tf
from tensorflow.python.ops import math_ops

from keras_tp.collectives.sequence import SEQUENCE_AXIS
from keras_tp.collectives.tensorflow_shards import GatheredSequence
from keras_tp.collectives.tensorflow_shards import SequenceShard
from keras_tp.collectives.tensorflow_shards import _adapter
from keras_tp.collectives.tensorflow_shards import _regather_of
from keras_tp.collectives.tensorflow_shards import _shard_like
from keras_tp.collectives.tensorflow_shards import _to_tensor
from keras_tp.collectives.tensorflow_shards import gathered
from keras_tp.collectives.tensorflow_shards import shards_of
from keras_tp.collectives.tensorflow_shards import whole_tensor
from keras_tp.collectives.tensorflow_shards import whole_tensors

# The types' names, handed on: importing them from here registers the
# rules below.
__all__ = [
    "GatheredSequence",
    "SequenceShard",
    "gathered",
    "shards_of",
    "whole_tensor",
    "whole_tensors",
]


def _regathered_product(x, weight, product):
    """`product(x.whole, weight)`, a contraction of `x`'s last axis with
    the first of a 2-D `weight`, whose gradient re-gathers `x`."""
    regather = _regather_of(x)

    @tf.custom_gradient
    def contracted(whole, weight):
        def grad(upstream):
            again = regather()
            features = again.shape[-1]
            weight_gradient = tf.matmul(
                tf.reshape(again, [-1, features]),
                tf.reshape(upstream, [-1, upstream.shape[-1]]),
                transpose_a=True,
            )
            return tf.matmul(upstream, weight, transpose_b=True), (
                weight_gradient
            )

        return product(whole, weight), grad

    return contracted(x.whole, tf.convert_to_tensor(weight))


def _is_matrix(weight):
    return getattr(weight, "shape", None) is not None and len(weight.shape) == 2


@tf.experimental.dispatch_for_api(tf.matmul, {"a": GatheredSequence})
def _matmul(
    a,
    b,
    transpose_a=False,
    transpose_b=False,
    adjoint_a=False,
    adjoint_b=False,
    a_is_sparse=False,
    b_is_sparse=False,
    output_type=None,
    grad_a=False,
    grad_b=False,
    name=None,
):
    # `tf.matmul`'s options, as passed: any set runs the product whole.
    options = dict(locals())
    del options["a"], options["b"], options["name"]
    if any(options.values()) or not _is_matrix(b):
        return tf.matmul(a.whole, b, name=name, **options)
    return _regathered_product(a, b, lambda x, w: tf.matmul(x, w, name=name))


@tf.experimental.dispatch_for_api(tf.tensordot, {"a": GatheredSequence})
def _tensordot(a, b, axes, name=None):
    last = [[a.ndim - 1], [0]]
    contracts_last = axes == 1 or [list(map(int, part)) for part in axes] in (
        last,
        [[-1], [0]],
    )
    if not (contracts_last and _is_matrix(b)):
        return tf.tensordot(a.whole, b, axes, name)
    return _regathered_product(
        a, b, lambda x, w: tf.tensordot(x, w, axes, name)
    )


@tf.experimental.dispatch_for_api(tf.cast, {"x": GatheredSequence})
def _cast_gathered(x, dtype, name=None):
    if tf.as_dtype(dtype) == x.dtype:
        return x
    return tf.cast(x.whole, dtype, name)


@tf.experimental.dispatch_for_api(tf.shape, {"input": GatheredSequence})
def _shape_gathered(input, out_type=None, name=None):
    return tf.shape(input.whole, out_type=out_type or tf.int32, name=name)


def _meeting(whole, shard):
    """The part of a whole tensor that meets `shard` in a pointwise
    operation, and whose gradient is made whole in the backward pass.

    Aligned from the right as broadcasting aligns them, `whole` either has
    the sequence axis (its rank's positions are kept: a slice whose
    gradient is all-gathered) or broadcasts over it (it is read as it is,
    and its gradient, a partial sum over the rank's positions, is
    all-reduced). A whole tensor of higher rank is `None`: the operation
    then runs whole.
    """
    offset = shard.ndim - whole.shape.rank
    if offset < 0:
        return None
    adapter = _adapter()
    differentiable = whole.dtype.is_floating or whole.dtype.is_complex
    axis = SEQUENCE_AXIS - offset
    if axis < 0 or whole.shape[axis] == 1:
        return adapter.copy_to_parallel(whole) if differentiable else whole
    if whole.shape[axis] != shard.length:
        return None
    return adapter.scatter_to_parallel(whole, axis)


@tf.experimental.dispatch_for_unary_elementwise_apis(SequenceShard)
def _unary(api_func, x):
    return _shard_like(api_func(x.local), x)


_Operand = typing.Union[SequenceShard, tf.Tensor]


@tf.experimental.dispatch_for_binary_elementwise_apis(_Operand, _Operand)
def _binary(api_func, x, y):
    shard = x if isinstance(x, SequenceShard) else y
    x, y = _to_tensor(x, shard.dtype), _to_tensor(y, shard.dtype)
    pieces = []
    for operand in (x, y):
        if isinstance(operand, SequenceShard):
            pieces.append(operand.local)
            continue
        piece = _meeting(operand, shard)
        if piece is None:
            return api_func(whole_tensor(x), whole_tensor(y))
        pieces.append(piece)
    return _shard_like(api_func(*pieces), shard)


def _register_operator(api):
    """Dispatches `api`, what a `tf.Tensor`'s `+` or `*` calls, as a binary
    elementwise API: a whole tensor added to a shard (a residual add)."""

    def operator(x, y, name=None):
        return _binary(api, x, y)

    for parameter in ("x", "y"):
        tf.experimental.dispatch_for_api(api, {parameter: SequenceShard})(
            operator
        )


# A `tf.Tensor`'s `+` calls this, which is not on TensorFlow's list of
# binary elementwise APIs (its `*` calls `tf.math.multiply`, which is).
_register_operator(math_ops._add_dispatch)


@tf.experimental.dispatch_for_api(tf.nn.bias_add, {"value": SequenceShard})
def _bias_add(value, bias, data_format=None, name=None):
    if data_format is not None and data_format.startswith("NC"):
        # The bias runs along axis 1, the sequence's.
        return tf.nn.bias_add(whole_tensor(value), bias, data_format, name)
    bias = _meeting(tf.convert_to_tensor(bias, dtype_hint=value.dtype), value)
    return _shard_like(
        tf.nn.bias_add(value.local, bias, data_format, name), value
    )


def _over_features(x, axis):
    """Whether reducing `x` over `axis` leaves its batch and sequence."""
    if axis is None:
        return False
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    rank = x.ndim
    return all(isinstance(a, int) and a % rank > SEQUENCE_AXIS for a in axes)


def _register_reduction(api):
    @tf.experimental.dispatch_for_api(api, {"input_tensor": SequenceShard})
    def reduction(input_tensor, axis=None, keepdims=False, name=None):
        if not _over_features(input_tensor, axis):
            return api(whole_tensor(input_tensor), axis, keepdims, name)
        local = api(input_tensor.local, axis, keepdims, name)
        return _shard_like(local, input_tensor)


for _api in (
    tf.math.reduce_sum,
    tf.math.reduce_mean,
    tf.math.reduce_max,
    tf.math.reduce_min,
    tf.math.reduce_prod,
    tf.math.reduce_variance,
    tf.math.reduce_std,
    tf.math.reduce_logsumexp,
):
    _register_reduction(_api)


@tf.experimental.dispatch_for_api(tf.nn.moments, {"x": SequenceShard})
def _moments(x, axes, shift=None, keepdims=False, name=None):
    if not _over_features(x, list(axes)):
        return tf.nn.moments(whole_tensor(x), axes, shift, keepdims, name)
    mean, variance = tf.nn.moments(x.local, axes, shift, keepdims, name)
    return _shard_like(mean, x), _shard_like(variance, x)


@tf.experimental.dispatch_for_api(tf.nn.softmax, {"logits": SequenceShard})
def _softmax(logits, axis=None, name=None):
    if axis is not None and not _over_features(logits, axis):
        return tf.nn.softmax(whole_tensor(logits), axis, name)
    return _shard_like(tf.nn.softmax(logits.local, axis, name), logits)


@tf.experimental.dispatch_for_api(tf.shape, {"input": SequenceShard})
def _shape(input, out_type=None, name=None):
    local = tf.shape(input.local, out_type=out_type or tf.int32, name=name)
    length = tf.constant([input.length], dtype=local.dtype)
    return tf.concat(
        [local[:SEQUENCE_AXIS], length, local[SEQUENCE_AXIS + 1 :]], 0
    )


@tf.experimental.dispatch_for_api(tf.identity, {"input": SequenceShard})
def _identity(input, name=None):
    return _shard_like(tf.identity(input.local, name), input)


@tf.experimental.dispatch_for_api(tf.stop_gradient, {"input": SequenceShard})
def _stop_gradient(input, name=None):
    return _shard_like(tf.stop_gradient(input.local, name), input)


@tf.experimental.dispatch_for_api(
    tf.nn.experimental.stateless_dropout, {"x": SequenceShard}
)
def _stateless_dropout(
    x, rate, seed, rng_alg=None, noise_shape=None, name=None
):
    """Draws the whole sequence's scaled mask from the seed, as one device
    does, and applies the rank's slice of it."""
    if noise_shape is None:
        noise_shape = tf.shape(x)
    scaled_mask = tf.nn.experimental.stateless_dropout(
        tf.ones(noise_shape, x.dtype), rate, seed, rng_alg, name=name
    )
    return x * scaled_mask
