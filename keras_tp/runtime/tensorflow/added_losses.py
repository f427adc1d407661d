"""Losses a model adds in its forward pass, on TensorFlow's replicas.

A layer's `add_loss` (a mixture-of-experts router's balancing loss, an
activity regularizer's penalty) appends to the layer's own list, which
the replicas share: they are threads of one process, and each replica's
call of the model starts by clearing those lists. So while a replica runs
the model, each loss added in its thread moves at once from the layer's
list into the replica's own record (`recorded`). The weights' regularizer
penalties are computed in the replica too, where a split weight is the
replica's slice (`keras_tp.split_regularizers` sums them over the ranks).
The step adds each data-parallel row's total to the loss it computes
outside the replicas, averaged over the rows, as DDP averages its ranks'.
"""

import contextlib
import threading
import weakref

import tensorflow as tf

from keras_tp.keras_internals import added_loss_count
from keras_tp.keras_internals import sublayers
from keras_tp.keras_internals import take_added_losses

_RECORDING = threading.local()
_RECORDED_LAYERS = weakref.WeakSet()


@contextlib.contextmanager
def recorded(model):
    """Inside, the losses `model`'s layers add in this thread are kept in
    the list it yields."""
    for layer in [model, *sublayers(model)]:
        if layer not in _RECORDED_LAYERS:
            _record_added_losses(layer)
            _RECORDED_LAYERS.add(layer)
    _RECORDING.losses = losses = []
    try:
        yield losses
    finally:
        _RECORDING.losses = None


def replica_total(model, added):
    """The sum of the losses `added` in this replica and of the
    regularizer penalties of `model`'s weights, as one float32 scalar."""
    terms = [
        tf.cast(tf.reduce_sum(loss), tf.float32)
        for loss in added + penalties(model)
    ]
    return tf.add_n(terms) if terms else tf.zeros(())


def penalties(model):
    """The regularizer penalties of `model`'s weights, as this replica
    reads them."""
    return [
        variable.regularizer(variable)
        for variable in model.trainable_weights
        if variable.regularizer is not None
    ]


def _record_added_losses(layer):
    add_loss = layer.add_loss

    def add_loss_of_replica(loss):
        losses = getattr(_RECORDING, "losses", None)
        if losses is None:
            return add_loss(loss)
        count = added_loss_count(layer)
        add_loss(loss)
        losses.extend(take_added_losses(layer, count))

    object.__setattr__(layer, "add_loss", add_loss_of_replica)
