"""The LM heads whose logits stay split by vocabulary.

While a train or test step is traced or run, a vocabulary-split head
(`keras_tp.vocab_parallel`) leaves each rank its part of the logits, and
the loss and metrics compute from those parts; everywhere else the head
gathers them whole.
"""

import contextlib

# A plain set, not a context variable: TensorFlow's replicas run in
# threads of their own.
_SPLIT_HEADS = set()


def logits_stay_split(layer):
    """Whether `layer`'s call returns its rank's logits, not all of them."""
    return id(layer) in _SPLIT_HEADS


@contextlib.contextmanager
def logits_split(layer):
    """Inside, the LM head `layer` leaves its logits split by vocabulary."""
    _SPLIT_HEADS.add(id(layer))
    try:
        yield
    finally:
        _SPLIT_HEADS.discard(id(layer))


@contextlib.contextmanager
def whole_logits():
    """Inside, every LM head gathers its logits whole, even in a step that
    would keep them split (a padded batch's loss is computed on the global
    batch's outputs, outside the ranks: `keras_tp.runtime.padding`)."""
    split = set(_SPLIT_HEADS)
    _SPLIT_HEADS.clear()
    try:
        yield
    finally:
        _SPLIT_HEADS.update(split)
