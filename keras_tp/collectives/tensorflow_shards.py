"""Sequence shards on TensorFlow: the extension types and their context.

A `SequenceShard` is this rank's slice of an activation split on its
sequence axis (axis 1) over the `model` ranks, whose `shape` is the whole
sequence's; a `GatheredSequence` is a region's input all-gathered from
such shards, which keeps the shard for the backward pass. This module
defines the types, the context of the replica step whose adapter splits
them (`shards_of`), and how a shard is made whole (`whole_tensor`, an
all-gather, counted). How TensorFlow's operations run on them is
`keras_tp.collectives.tensorflow_sequence`, whose dispatch rules are
registered when it is imported: take these names from there.
"""

import contextlib
import contextvars

import tensorflow as tf

from keras_tp.collectives.sequence import SEQUENCE_AXIS

# The `model`-axis adapter whose ranks split the sequence shards of the
# code running in this thread (a replica's step).
_ADAPTER = contextvars.ContextVar("keras_tp_sequence_adapter", default=None)


# The backward pass's gathers of the shards that entered regions in this
# forward pass, by shard: one per shard, however many products read it.
_REGATHERS = contextvars.ContextVar("keras_tp_regathers", default=None)


@contextlib.contextmanager
def shards_of(adapter):
    """The context of a replica's forward pass whose shards `adapter`
    splits."""
    token = _ADAPTER.set(adapter)
    regathers = _REGATHERS.set({})
    try:
        yield
    finally:
        _REGATHERS.reset(regathers)
        _ADAPTER.reset(token)


def _adapter():
    adapter = _ADAPTER.get()
    if adapter is None:
        raise RuntimeError(
            "A sequence shard of keras_tp's sequence parallelism was used "
            "outside the replica step that made it. Return whole tensors "
            "from the model (its outputs are gathered), or pass "
            "sequence_parallel=False."
        )
    return adapter


class _TensorLike:
    """What Keras reads of a tensor, for the extension types below, which
    hold this rank's slice of the sequence as `local`."""

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def ndim(self):
        return self.local.shape.rank

    def get_shape(self):
        return self.shape

    def is_tensor_like(self):
        """Makes `tf.is_tensor` true, so that Keras takes the value as a
        tensor rather than converting it (gathering it)."""


def _operators(api):
    """A binary operator and its reflection, both calling `api` with the
    other operand as a tensor (a Python number, a Keras variable), so that
    TensorFlow's dispatch sees the shard."""

    def operator(self, other):
        return api(self, _to_tensor(other, self.dtype))

    def reflected(self, other):
        return api(_to_tensor(other, self.dtype), self)

    return operator, reflected


class SequenceShard(_TensorLike, tf.experimental.ExtensionType):
    """This rank's slice of an activation split on its sequence axis.

    Attributes:
        local: the slice, of shape `(batch, length / ranks, ...)`.
        length: the whole sequence's length.
    """

    local: tf.Tensor
    length: int

    @property
    def shape(self):
        """The whole activation's shape."""
        shape = self.local.shape.as_list()
        shape[SEQUENCE_AXIS] = self.length
        return tf.TensorShape(shape)

    def __tf_tensor__(self, dtype=None, name=None):
        whole = whole_tensor(self)
        return whole if dtype is None else tf.cast(whole, dtype)

    # Python's operators, as TensorFlow's APIs that dispatch on shards.
    __add__, __radd__ = _operators(tf.math.add)
    __sub__, __rsub__ = _operators(tf.math.subtract)
    __mul__, __rmul__ = _operators(tf.math.multiply)
    __truediv__, __rtruediv__ = _operators(tf.math.truediv)
    __pow__, __rpow__ = _operators(tf.math.pow)
    __gt__, __lt__ = _operators(tf.math.greater)[0], _operators(tf.less)[0]
    __ge__ = _operators(tf.math.greater_equal)[0]
    __le__ = _operators(tf.math.less_equal)[0]

    def __abs__(self):
        return tf.math.abs(self)

    def __neg__(self):
        return tf.math.negative(self)

    def __getitem__(self, key):
        return whole_tensor(self)[key]


def whole_tensor(x):
    """`x` made whole: a shard all-gathered (counted), its gradient, the
    same on every rank, sliced back; any other value as it is."""
    if not isinstance(x, SequenceShard):
        return x
    if x.dtype == tf.bool:
        # TensorFlow's collectives move numbers only.
        whole = whole_tensor(_shard_like(tf.cast(x.local, tf.int32), x))
        return tf.cast(whole, tf.bool)
    return _adapter().gather_from_parallel(x.local, SEQUENCE_AXIS)


class GatheredSequence(_TensorLike, tf.experimental.ExtensionType):
    """A region's input all-gathered from its sequence shards, which keeps
    the shard for the backward pass.

    The split layers' products with their weights (a `Dense`'s
    `tensordot`, an `EinsumDense`'s `matmul`) read `whole` forward; for
    the weights' gradients the backward pass gathers `local` again, once
    however many products read it, so that only the shard is held
    between the passes: Megatron's re-gather. Any other operation reads
    `whole` as a tensor.

    Attributes:
        whole: the gathered input, whose gradient is reduce-scattered.
        local: this rank's shard of it.
    """

    whole: tf.Tensor
    local: tf.Tensor

    @property
    def shape(self):
        return self.whole.shape

    def __tf_tensor__(self, dtype=None, name=None):
        return self.whole if dtype is None else tf.cast(self.whole, dtype)


def gathered(adapter, shard):
    """`shard` all-gathered where it enters a region (`gather_sequence`),
    as a `GatheredSequence` whose products re-gather it backward."""
    whole = adapter.gather_sequence(shard.local, SEQUENCE_AXIS)
    return GatheredSequence(whole=whole, local=shard.local)


class _Regather:
    """The backward pass's gather of one shard, made by the first product
    whose gradient needs it."""

    def __init__(self, adapter, local):
        self.adapter = adapter
        self.local = local
        self.whole = None

    def __call__(self):
        if self.whole is None:
            self.whole = self.adapter.regather_sequence(
                self.local, SEQUENCE_AXIS
            )
        return self.whole


def _regather_of(x):
    regathers = _REGATHERS.get()
    key = x.local.ref()
    if key not in regathers:
        regathers[key] = _Regather(_adapter(), x.local)
    return regathers[key]


def whole_tensors(structure):
    """`structure` with every shard made whole (`whole_tensor`)."""
    return tf.nest.map_structure(whole_tensor, structure)


def _shard_like(local, reference):
    return SequenceShard(local=local, length=reference.length)


def _to_tensor(value, dtype):
    """A shard as it is; any other operand (a Python number, a Keras
    variable) as a tensor, so that dispatch sees its type."""
    if isinstance(value, SequenceShard):
        return value
    return tf.convert_to_tensor(value, dtype_hint=dtype)
