"""Gradient buckets sent during the backward pass.

As in PyTorch DDP, gradients are sent while the backward pass computes
the gradients of earlier layers: an all-reduce bucket is one flat vector
cut into calls of `bucket_cap_mb`, in reverse order of the variables (the
order the backward pass makes their gradients), and each call starts as
soon as the gradients it covers exist. The optimizer then only waits for
what is still in flight: the runtime attaches a `BackwardOverlap` as
`CoordinatedOptimizer.backward_overlap`, and the optimizer's buckets take
it as their codec (see `buckets.PlainCodec`). The runtime says when each
gradient is ready (torch: a post-accumulate-grad hook per parameter); the
calls are the optimizer's own, so the numbers and the counted bytes are
those of the step without overlap.
"""

import time

from keras import ops

from keras_tp.parallel.buckets import FlatPieces
from keras_tp.parallel.buckets import PlainCodec
from keras_tp.tensors import nbytes


class BackwardOverlap(PlainCodec):
    """Starts each piece of each bucket when its gradients are ready.

    The codec of the steps the optimizer overlaps: a bucket's all-reduce
    waits for the pieces the backward pass started, and sends the rest.

    Args:
        buckets: the optimizer's `Bucket`s; the all-reduce ones overlap.
        variables: the trainable variables, in the optimizer's order.
        adapter: the collective adapter of the `data` axis.
    """

    def __init__(self, buckets, variables, adapter):
        self.adapter = adapter
        self.buckets = [b for b in buckets if not b.partitioned]
        position = {id(v): i for i, v in enumerate(variables)}
        # variable index -> (bucket, its position in the bucket)
        self._slot_of = {}
        self._pieces = {}
        for bucket in self.buckets:
            for k, variable in enumerate(bucket.variables):
                self._slot_of[position[id(variable)]] = (bucket, k)
            self._pieces[bucket.index] = FlatPieces(
                bucket.shapes,
                nbytes(bucket.variables[0], (1,)),
                bucket.cap_bytes,
            )
        self._timeline = []
        self.active = False

    def start_step(self):
        """Forgets the last step's gradients; called before each step.

        Gradients count only from here until the optimizer has taken
        every bucket: a backward pass outside a training step starts
        nothing.
        """
        self.active = True
        self._flats = {bucket.index: {} for bucket in self.buckets}
        self._waits = {bucket.index: [] for bucket in self.buckets}
        self._times = {}
        self._taken = 0
        self._start = time.perf_counter()

    def gradient_ready(self, index, gradient):
        """Records the gradient of the `index`-th variable and starts the
        pieces of its bucket that are now complete, in order."""
        slot = self._slot_of.get(index)
        if slot is None or not self.active:
            return
        bucket, k = slot
        self._flats[bucket.index][k] = ops.reshape(gradient, (-1,))
        self._start_ready(bucket)

    def all_reduce(self, bucket, values, adapter):
        """The averaged gradients of `bucket`.

        Starts the pieces the backward pass did not complete (their
        variables got no gradient: `values` holds the optimizer's zeros
        for them), then waits for every piece. Outside a step, or for a
        bucket that does not overlap, an all-reduce as without overlap.

        Args:
            bucket: the bucket.
            values: the gradients of its variables, in its order.
            adapter: the collective adapter of the `data` axis.
        """
        if not self.active or bucket.index not in self._waits:
            return super().all_reduce(bucket, values, adapter)
        flats = self._flats[bucket.index]
        for k, gradient in enumerate(values):
            flats.setdefault(k, ops.reshape(gradient, (-1,)))
        self._start_ready(bucket)
        pieces = [wait() for wait in self._waits[bucket.index]]
        self._times[bucket.index]["finished"] = self._elapsed()
        self._taken += 1
        if self._taken == len(self.buckets):
            self._end_step()
        return self._pieces[bucket.index].assemble(pieces)

    def timeline(self):
        """When the buckets of the last step were ready and finished.

        Returns:
            A list of `{"bucket", "first_ready", "ready", "finished"}`, in
            seconds since the step started: when its first piece started
            (its gradients were ready), when its last one did, and when
            the optimizer had the result.
        """
        return list(self._timeline)

    def _end_step(self):
        """Keeps the step's per-bucket times for `timeline()`."""
        self.active = False
        self._timeline = [
            {"bucket": index, **times}
            for index, times in sorted(self._times.items())
        ]

    def _start_ready(self, bucket):
        pieces = self._pieces[bucket.index]
        flats = self._flats[bucket.index]
        waits = self._waits[bucket.index]
        while len(waits) < len(pieces.ranges) and all(
            i in flats for i in pieces.covered(len(waits))
        ):
            # Counted as the optimizer's, as without overlap.
            with self.adapter.stats.labelled("optimizer"):
                waits.append(
                    self.adapter.all_reduce_async(
                        pieces.piece(len(waits), flats), "mean"
                    )
                )
            times = self._times.setdefault(
                bucket.index, {"first_ready": self._elapsed()}
            )
            times["ready"] = self._elapsed()

    def _elapsed(self):
        return time.perf_counter() - self._start
