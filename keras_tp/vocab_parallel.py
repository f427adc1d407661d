"""Vocabulary-parallel loss: an LM head's logits stay split by vocabulary.

A language model's head (a `ReversibleEmbedding` called with
`reverse=True`, or a last `Dense` split as a gathering `Column`) computes
each rank's logits for its rows of the vocabulary. Gathered, they are the
largest activation of the step: batch x sequence x vocabulary floats on
every device. When the model's one output is that head's, and its loss is
a sparse categorical cross-entropy from logits, training and evaluation
keep them split, as Megatron's `vocab_parallel_cross_entropy` and torch's
`loss_parallel` do:

- the loss of each token is `log(sum exp(z - m)) + m - z[target]`, where
  the maximum `m` is all-reduced over `model` (no gradient) and the local
  sums of exponentials and the target's logit (from the rank that holds
  it) are all-reduced together, once: two all-reduces of
  batch x sequence floats instead of an all-gather of the logits;
- the accuracy's arg-max is the first index that holds the maximum, an
  all-reduce `min` of each rank's candidate.

Keras still reduces the per-token values (sample weights, masks, the
loss's reduction), so the loss is the one Keras computes on one device.
`predict()` and direct calls gather the logits whole, as before.
"""

import contextlib
import copy
import logging

import keras
from keras import ops

from keras_tp.keras_internals import layer_call_nodes
from keras_tp.keras_internals import loss_function_arguments
from keras_tp.keras_internals import metric_function
from keras_tp.keras_internals import node_call_arguments
from keras_tp.keras_internals import node_operation
from keras_tp.keras_internals import producer_node
from keras_tp.keras_internals import set_metric_function
from keras_tp.plan.split_logits import logits_split
from keras_tp.plan.split_logits import logits_stay_split
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Vocab

logger = logging.getLogger(__name__)

# The heads inside whose `splitting()` the program runs, innermost last.
_ACTIVE_HEADS = []

_ACCURACY_NAMES = ("accuracy", "acc", "sparse_categorical_accuracy")


class VocabParallelHead:
    """The LM head whose logits stay split in training and evaluation.

    Args:
        layer: the head layer.
        runtime: the runtime the model runs on.
    """

    def __init__(self, layer, runtime):
        self.layer = layer
        self.runtime = runtime
        # What the loss and the metrics compute from split logits.
        self.split_functions = []

    @contextlib.contextmanager
    def splitting(self):
        """A context inside which the head leaves its logits split."""
        with logits_split(self.layer):
            _ACTIVE_HEADS.append(self)
            try:
                yield
            finally:
                _ACTIVE_HEADS.pop()

    def split_aware(self, whole_fn, split_fn):
        """`whole_fn(y_true, y_pred, **kwargs)`, or `split_fn` run on every
        model rank's logits while the head's logits are split."""
        if split_fn not in self.split_functions:
            self.split_functions.append(split_fn)

        def function(y_true, y_pred, **kwargs):
            if not logits_stay_split(self.layer):
                return whole_fn(y_true, y_pred, **kwargs)
            return self.runtime.run_split_function(
                split_fn, (y_true, y_pred), (None, len(y_pred.shape) - 1)
            )

        return function

    def per_token(self, adapter, labels, logits):
        """Each of `split_functions` computed on this rank's logits.

        For runtimes whose steps compute the loss outside the ranks
        (TensorFlow's): each rank computes these per-token values, and
        they stand for the logits where the loss and metrics read them
        (`column`). Their gradient flows back to the rank's logits.

        Args:
            adapter: the `model`-axis collective adapter.
            labels: the target ids of the rank's batch, whole.
            logits: this rank's logits, its rows of the vocabulary last.

        Returns:
            The values stacked on a last axis, one per split function, in
            float32; at least two, since Keras' losses squeeze a last
            axis of 1 away where the labels have none.
        """
        values = [
            ops.cast(function(adapter, labels, logits), "float32")
            for function in self.split_functions
        ]
        if len(values) == 1:
            values.append(ops.zeros_like(values[0]))
        return ops.stack(values, -1)

    def column(self, function, values):
        """`function`'s values among `per_token`'s."""
        return values[..., self.split_functions.index(function)]


def split_head():
    """The `VocabParallelHead` whose logits stay split now (inside a train
    or test step that keeps them split), or `None`."""
    for head in reversed(_ACTIVE_HEADS):
        if logits_stay_split(head.layer):
            return head
    return None


def splitting_logits(head):
    """Inside, `head` (a `VocabParallelHead`, or `None`) keeps its logits
    split: the train and test steps run inside."""
    return head.splitting() if head is not None else contextlib.nullcontext()


def vocab_parallel_head(model, plan, runtime, loss, metrics):
    """The model's `VocabParallelHead`, or `None` with the reason logged.

    Args:
        model: the wrapped model.
        plan: its bound `ShardingPlan`.
        runtime: the runtime.
        loss: the loss given to `compile`.
        metrics: every metric given to `compile` (plain and weighted).
    """
    head, reason = _output_head(model, plan)
    if head is not None:
        reason = runtime.whole_logits_reason or _loss_refusal(loss, metrics)
    if reason is not None:
        if head is not None:
            logger.info(
                "Logits of layer '%s' are gathered whole: %s",
                head.path,
                reason,
            )
        return None
    return VocabParallelHead(head, runtime)


def with_split_logits(model, plan, runtime, kwargs):
    """`compile`'s arguments, made to read the head's split logits.

    Args:
        model: the wrapped model.
        plan: its bound `ShardingPlan`.
        runtime: the runtime.
        kwargs: `keras.Model.compile`'s arguments by name.

    Returns:
        `(kwargs, head)`: a copy of the loss whose function runs split and
        the metrics with their function split-aware, and the
        `VocabParallelHead`; or `(kwargs, None)` unchanged where the
        logits must be whole (the reason is logged).
    """
    names = ("metrics", "weighted_metrics")
    lists = [kwargs.get(name) or [] for name in names]
    if not all(isinstance(m, (list, tuple)) for m in lists):
        return kwargs, None
    loss = kwargs.get("loss")
    head = vocab_parallel_head(model, plan, runtime, loss, sum(lists, []))
    if head is None:
        return kwargs, None
    kwargs = dict(kwargs)
    kwargs["loss"] = copy.copy(loss)
    kwargs["loss"].fn = head.split_aware(loss.fn, sparse_cross_entropy)
    for name, metrics in zip(names, lists):
        if metrics:
            kwargs[name] = [_split_metric(head, m) for m in metrics]
    return kwargs, head


def _split_metric(head, metric):
    if isinstance(metric, str):
        metric = keras.metrics.SparseCategoricalAccuracy(name=metric)
    whole = metric_function(metric)
    set_metric_function(metric, head.split_aware(whole, sparse_accuracy))
    return metric


def sparse_cross_entropy(adapter, labels, logits):
    """Each token's cross-entropy from this rank's logits of the vocabulary.

    Args:
        adapter: the `model`-axis collective adapter.
        labels: the target ids, whole (any integer or float dtype).
        logits: this rank's logits, its rows of the vocabulary last.

    Returns:
        The loss of each token, the same on every rank.
    """
    logits = ops.cast(logits, "float32")
    labels = _labels(labels, logits)
    top = adapter.all_reduce(ops.max(ops.stop_gradient(logits), -1), "max")
    shifted = ops.subtract(logits, ops.expand_dims(top, -1))
    local, held = _local_labels(adapter, labels, logits.shape[-1])
    target = ops.take_along_axis(shifted, ops.expand_dims(local, -1), -1)
    target = ops.where(held, ops.squeeze(target, -1), 0.0)
    sums = ops.stack([ops.sum(ops.exp(shifted), -1), target], -1)
    sums = adapter.reduce_from_parallel(sums)
    return ops.subtract(ops.log(sums[..., 0]), sums[..., 1])


def sparse_accuracy(adapter, labels, logits):
    """Whether each token's arg-max over the whole vocabulary is its label.

    As `ops.argmax` does, the first index holding the maximum wins.

    Returns:
        `1.0` where the prediction is right, else `0.0` (Keras' floatx).
    """
    logits = ops.stop_gradient(logits)
    labels = _labels(labels, logits)
    rows = logits.shape[-1]
    local_max = ops.max(logits, -1)
    top = adapter.all_reduce(local_max, "max")
    first = ops.cast(ops.argmax(logits, -1), "int32") + _offset(adapter, rows)
    # Past every index: a rank without the maximum never wins the `min`.
    beyond = rows * adapter.size()
    candidate = ops.where(ops.equal(local_max, top), first, beyond)
    first = adapter.all_reduce(ops.cast(candidate, "int32"), "min")
    return ops.cast(ops.equal(first, labels), keras.config.floatx())


def _labels(labels, logits):
    """Integer labels, with a trailing axis of 1 dropped (as Keras does)."""
    if len(labels.shape) == len(logits.shape) and labels.shape[-1] == 1:
        labels = ops.squeeze(labels, -1)
    return ops.cast(labels, "int32")


def _offset(adapter, rows):
    return ops.cast(adapter.rank(), "int32") * rows


def _local_labels(adapter, labels, rows):
    """Each label as an index into this rank's rows, and whether it is one
    of them (elsewhere index 0, masked by the caller)."""
    local = labels - _offset(adapter, rows)
    held = ops.logical_and(local >= 0, local < rows)
    return ops.where(held, local, 0), held


def _output_head(model, plan):
    """`(layer, None)` if the model's one output is a vocabulary-split
    head's call, else `(None, reason)`."""
    outputs = keras.tree.flatten(getattr(model, "outputs", None) or [])
    produced = producer_node(outputs[0]) if len(outputs) == 1 else None
    if produced is None:
        return None, "the model is not Functional with one output"
    node = produced[0]
    layer = node_operation(node)
    entry = next((e for e in plan.layers if e.layer is layer), None)
    if entry is None:
        return None, "its output does not come from a split layer"
    if isinstance(entry.style, Vocab):
        reverse = [
            n
            for n in layer_call_nodes(layer)
            if node_call_arguments(n)[1].get("reverse")
        ]
        if reverse != [node]:
            return None, "the embedding is not called once as the LM head"
        return layer, None
    if not (
        isinstance(entry.style, Column)
        and entry.style.gather_output
        and isinstance(layer, keras.layers.Dense)
        and len(layer_call_nodes(layer)) == 1
        and layer.activation in (None, keras.activations.linear)
    ):
        return None, "its output is not a linear vocabulary-split head's"
    return layer, None


def _loss_refusal(loss, metrics):
    """Why the compiled loss and metrics cannot read split logits, or
    `None` if they can."""
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return (
            f"the loss is {loss!r}; only SparseCategoricalCrossentropy("
            "from_logits=True) is computed from split logits"
        )
    kwargs = loss_function_arguments(loss)
    if not kwargs.get("from_logits") or kwargs.get("ignore_class") is not None:
        return "the loss needs from_logits=True and no ignore_class"
    for metric in metrics:
        if isinstance(metric, str) and metric in _ACCURACY_NAMES:
            continue
        if isinstance(metric, keras.metrics.SparseCategoricalAccuracy):
            continue
        return (
            f"metric {metric!r} reads whole logits; only sparse categorical "
            "accuracy is computed from split ones"
        )
    return None
