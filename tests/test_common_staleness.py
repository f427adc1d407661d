"""`StalenessBound`, the servers' rule, on schedules written by hand and
drawn at random (pure bookkeeping: no backend runs)."""

import random

import pytest

from keras_tp.asynchronous.staleness import StalenessBound


def test_synchronous_bound_groups_one_gradient_per_worker():
    bound = StalenessBound(0)
    for worker in range(3):
        bound.start(worker)
    bound.push(2, "c")
    bound.push(0, "a")
    assert not bound.ready()
    bound.push(1, "b")
    group = bound.take()
    assert [pushed.payload for pushed in group] == ["a", "b", "c"]
    assert bound.version == 1
    assert dict(bound.histogram) == {0: 3}


def test_a_worker_that_finishes_after_a_push_without_pull_stays_finished():
    bound = StalenessBound(0)
    bound.start(0)
    bound.start(1)
    bound.push(0, "a", pulls=False)
    bound.finish(0)
    bound.push(1, "b")
    bound.take()
    bound.push(1, "c")
    assert bound.ready()


def test_pushing_without_holding_parameters_is_refused():
    bound = StalenessBound(1)
    with pytest.raises(RuntimeError, match="it must pull first"):
        bound.push(0, "a")
    with pytest.raises(ValueError, match="max_staleness must be an integer"):
        StalenessBound(-1)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
@pytest.mark.parametrize("pull_every", [1, 2])
def test_random_schedules_respect_the_bound_and_finish(
    max_staleness, pull_every
):
    """Workers push in a random order; every gradient is applied, none
    later than the bound, and the servers never wait on nobody."""
    rng = random.Random(max_staleness * 10 + pull_every)
    workers, steps = 4, 12
    bound = StalenessBound(max_staleness)
    left = {w: steps for w in range(workers)}
    waiting = set()
    for w in range(workers):
        bound.start(w)
    applied = 0
    while left or waiting:
        # A worker whose gradient waits cannot act until it is applied.
        free = [w for w in left if w not in waiting]
        assert free or bound.ready(), "the servers wait on nobody"
        if free:
            worker = rng.choice(free)
            left[worker] -= 1
            pulls = left[worker] % pull_every == 0 or not left[worker]
            bound.push(worker, pulls, pulls)
            if pulls:
                waiting.add(worker)
            if not left[worker]:
                del left[worker]
                bound.finish(worker)
        while bound.ready():
            group = bound.take()
            applied += len(group)
            for pushed in group:
                if pushed.payload:  # the push pulled
                    waiting.discard(pushed.worker)
                    if pushed.worker in left:
                        bound.start(pushed.worker)
    assert applied == workers * steps
    assert max(bound.histogram) <= max_staleness
    assert bound.idle
