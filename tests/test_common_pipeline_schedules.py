"""Pipeline schedules: GPipe and 1F1B orders, simulated timelines, bubbles.

Pure Python: nothing here runs a model.
"""

import itertools

import pytest

from keras_tp.pipeline import schedules
from keras_tp.pipeline.schedules import BACKWARD
from keras_tp.pipeline.schedules import FORWARD
from keras_tp.pipeline.schedules import Action
from keras_tp.pipeline.schedules import bubble_fraction
from keras_tp.pipeline.schedules import gpipe
from keras_tp.pipeline.schedules import ideal_bubble
from keras_tp.pipeline.schedules import one_f_one_b
from keras_tp.pipeline.schedules import peak_activations
from keras_tp.pipeline.schedules import simulate

SCHEDULES = [gpipe, one_f_one_b]
SIZES = list(itertools.product(range(1, 6), range(1, 9)))  # (P, M)


def short(actions):
    return [a.kind[0] + str(a.microbatch) for a in actions]


def test_gpipe_runs_all_forwards_then_all_backwards():
    schedule = gpipe(3, 4)
    assert len(schedule) == 3
    for s, actions in enumerate(schedule):
        assert all(a.stage == s for a in actions)
        assert short(actions) == [
            "f0",
            "f1",
            "f2",
            "f3",
            "b0",
            "b1",
            "b2",
            "b3",
        ]


def test_one_f_one_b_warms_up_alternates_and_cools_down():
    schedule = one_f_one_b(3, 5)
    assert short(schedule[0]) == [
        "f0",
        "f1",
        "f2",
        "b0",
        "f3",
        "b1",
        "f4",
        "b2",
        "b3",
        "b4",
    ]
    assert short(schedule[1]) == [
        "f0",
        "f1",
        "b0",
        "f2",
        "b1",
        "f3",
        "b2",
        "f4",
        "b3",
        "b4",
    ]
    assert short(schedule[2]) == [
        "f0",
        "b0",
        "f1",
        "b1",
        "f2",
        "b2",
        "f3",
        "b3",
        "f4",
        "b4",
    ]
    # Fewer microbatches than stages: the early stages' warm-ups take
    # every forward; only the last stage alternates.
    small = one_f_one_b(4, 2)
    assert [short(actions) for actions in small[:3]] == [
        ["f0", "f1", "b0", "b1"]
    ] * 3
    assert short(small[3]) == ["f0", "b0", "f1", "b1"]


@pytest.mark.parametrize("make", SCHEDULES)
@pytest.mark.parametrize("num_stages, num_microbatches", SIZES)
def test_every_stage_runs_each_pass_once(make, num_stages, num_microbatches):
    for s, actions in enumerate(make(num_stages, num_microbatches)):
        expected = {
            Action(s, kind, m)
            for kind in (FORWARD, BACKWARD)
            for m in range(num_microbatches)
        }
        assert len(actions) == len(expected)
        assert set(actions) == expected
        for m in range(num_microbatches):  # a backward after its forward
            assert actions.index(Action(s, FORWARD, m)) < actions.index(
                Action(s, BACKWARD, m)
            )


@pytest.mark.parametrize("make", SCHEDULES)
@pytest.mark.parametrize("times", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.7)])
def test_simulate_respects_dependencies_and_runs_early(make, times):
    forward, backward = times
    schedule = make(4, 6)
    timeline = simulate(schedule, forward, backward)
    for s, (actions, spans) in enumerate(zip(schedule, timeline.spans)):
        assert [span.action for span in spans] == actions  # list order
        previous_end = 0.0
        for span in spans:
            stage, kind, m = span.action
            duration = forward if kind == FORWARD else backward
            assert span.end - span.start == pytest.approx(duration)
            needs = []
            if kind == FORWARD and stage > 0:
                needs.append(Action(stage - 1, FORWARD, m))
            if kind == BACKWARD:
                needs.append(Action(stage, FORWARD, m))
                if stage < 3:
                    needs.append(Action(stage + 1, BACKWARD, m))
            ready = [timeline.span_of(n).end for n in needs]
            # One action at a time; each after what it needs, and no later.
            assert span.start >= previous_end
            assert all(span.start >= end for end in ready)
            assert span.start == pytest.approx(max([previous_end] + ready))
            previous_end = span.end


@pytest.mark.parametrize("make", SCHEDULES)
@pytest.mark.parametrize("num_stages, num_microbatches", SIZES)
@pytest.mark.parametrize("times", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.5)])
def test_measured_bubble_is_the_ideal_one(
    make, num_stages, num_microbatches, times
):
    # With equal stages, both schedules take M + P - 1 forward-and-backward
    # times: the forward of the first microbatch reaches the last stage
    # after P - 1 forwards, that stage then runs its 2M actions without a
    # gap, and the last backward returns to stage 0 after P - 1 backwards.
    # Every stage is busy M (f + b) of it, whatever b / f.
    forward, backward = times
    timeline = simulate(make(num_stages, num_microbatches), forward, backward)
    expected = ideal_bubble(num_stages, num_microbatches)
    assert expected == (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert timeline.makespan == pytest.approx(
        (num_microbatches + num_stages - 1) * (forward + backward)
    )
    for fraction in bubble_fraction(timeline):
        assert fraction == pytest.approx(expected, abs=1e-12)


def test_unequal_stages_idle_more_than_the_ideal():
    # The pipeline runs at the pace of its slowest stage.
    # Stage 1 takes twice as long: it starts after stage 0's first forward
    # (1), runs its 8 x (2 + 4) without a gap, and stage 0's last backward
    # (2) follows.
    timeline = simulate(one_f_one_b(2, 8), [1.0, 2.0], [2.0, 4.0])
    assert timeline.makespan == 51.0
    fractions = bubble_fraction(timeline)
    assert fractions == pytest.approx([1 - 24 / 51, 3 / 51])
    assert sum(fractions) / 2 > ideal_bubble(2, 8) + 0.15


@pytest.mark.parametrize("num_stages, num_microbatches", SIZES)
def test_peak_activations(num_stages, num_microbatches):
    assert (
        peak_activations(gpipe(num_stages, num_microbatches))
        == [num_microbatches] * num_stages
    )
    peaks = peak_activations(one_f_one_b(num_stages, num_microbatches))
    assert peaks == [
        min(num_stages - s, num_microbatches) for s in range(num_stages)
    ]
    assert max(peaks) <= num_stages


def test_chart_draws_each_stage():
    chart = simulate(one_f_one_b(2, 3), 1.0, 2.0).chart()
    assert chart.splitlines() == [
        "stage 0: 01..aa2bb.cc",
        "stage 1: .0aa1bb2cc..",
    ]


def test_a_deadlocking_schedule_is_refused():
    schedule = [
        [
            Action(0, FORWARD, 0),
            Action(0, BACKWARD, 0),
            Action(0, FORWARD, 1),
            Action(0, BACKWARD, 1),
        ],
        [
            Action(1, FORWARD, 0),
            Action(1, FORWARD, 1),
            Action(1, BACKWARD, 0),
            Action(1, BACKWARD, 1),
        ],
    ]
    with pytest.raises(ValueError, match="deadlocks.*stage 0.*stage 1"):
        simulate(schedule)
    # Tuples work as actions.
    timeline = simulate(
        [[tuple(a) for a in actions] for actions in gpipe(2, 2)]
    )
    assert timeline.makespan == 9.0


def test_bad_arguments_are_refused():
    for make in SCHEDULES + [ideal_bubble]:
        with pytest.raises(ValueError, match="num_microbatches must be an i"):
            make(2, 0)
        with pytest.raises(ValueError, match="num_stages must be an integer"):
            make(0, 2)
        with pytest.raises(ValueError, match="got 1.5"):
            make(2, 1.5)
        with pytest.raises(ValueError, match="num_stages .* >= 1, got True"):
            make(True, 2)
    with pytest.raises(ValueError, match="one per stage"):
        simulate(gpipe(3, 2), forward_time=[1.0, 1.0])
    with pytest.raises(ValueError, match="must be >= 0"):
        simulate(gpipe(2, 2), backward_time=-1.0)
    with pytest.raises(ValueError, match="an action of stage 1"):
        simulate([[Action(1, FORWARD, 0)]])
    with pytest.raises(ValueError, match="kind must be"):
        simulate([[Action(0, "fwd", 0)]])
    with pytest.raises(ValueError, match="but not their forward"):
        simulate([[Action(0, BACKWARD, 0)]])
    with pytest.raises(ValueError, match="appears twice"):
        simulate([[Action(0, FORWARD, 0), Action(0, FORWARD, 0)]])
    with pytest.raises(ValueError, match="same microbatches"):
        simulate([[Action(0, FORWARD, 0)], [Action(1, FORWARD, 1)]])
    with pytest.raises(ValueError, match="non-empty list"):
        simulate([])


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_issue_order_puts_each_action_after_what_it_waits_for(name):
    order = schedules.issue_order(name, 3, 5)
    position = {action: i for i, action in enumerate(order)}
    assert len(order) == 2 * 3 * 5
    for (stage, kind, m), i in position.items():
        if kind == schedules.FORWARD and stage:
            assert position[(stage - 1, schedules.FORWARD, m)] < i
        if kind == schedules.BACKWARD:
            assert position[(stage, schedules.FORWARD, m)] < i
            if stage < 2:
                assert position[(stage + 1, schedules.BACKWARD, m)] < i


def test_runner_arguments_are_checked():
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedules.issue_order("interleaved", 2, 4)
    with pytest.raises(ValueError, match="cannot be split into"):
        schedules.check_microbatches(10, 4)
    schedules.check_microbatches(12, 4)
