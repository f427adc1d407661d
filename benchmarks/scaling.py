"""Item 7: cost as the work grows, JAX TP=2 from hidden 256 to 2048.

For each width the LM is trained with keras_tp at TP=2 and, interleaved,
on one device. Per width:

- the step time of TP=2 relative to one device (both on the same two
  cores, so this shows overhead shrinking, not a speed-up);
- the peak memory of one device in the compiled step (`memory_analysis()`);
- the communication share: the time the devices spend in collective ops
  over the time they spend in all ops, from a `jax.profiler` trace of the
  TP=2 steps (XLA's CPU runtime records each executed HLO op).

Compute grows with hidden squared and the all-reduced activations with
hidden, so the share should fall.
"""

import collections
import glob
import re
import tempfile
import time

import jax

import keras_tp
from benchmarks import jax_steps
from benchmarks import models
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio
from benchmarks.timing import spread

# HLO instruction names of collectives, as XLA or JAX's primitives name
# them (`all-reduce.3`, `psum_invariant.31`, `all_gather_invariant.2`).
COLLECTIVE_OP = re.compile(
    r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|"
    r"psum|all_gather|reduce_scatter|ppermute"
)
# An executed HLO op in the trace: a lower-case instruction name, as
# opposed to the runtime's own events (`ThunkExecutor::Execute`,
# `Rendezvous`, `end: copy.3`).
HLO_OP = re.compile(r"^[a-z][\w\-]*(\.\d+)?$")


def run(
    progress, hidden_sizes, blocks, heads, seq_len, vocab, batch, steps, repeats
):
    """Sweeps the LM's width at TP=2.

    Args:
        progress: callable taking the fraction of the work done.
        hidden_sizes: widths to measure, smallest first.
        blocks, heads, seq_len, vocab: the rest of the LM's shape.
        batch: batch size.
        steps: training steps per timed `fit()` epoch.
        repeats: timed rounds per width.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    x, y = models.language_data(batch * steps, seq_len, vocab)
    fit_args = dict(x=x, y=y, batch_size=batch, shuffle=False, verbose=0)
    sweep = []
    for index, hidden in enumerate(hidden_sizes):
        shape = dict(
            dim=hidden, blocks=blocks, heads=heads, seq_len=seq_len, vocab=vocab
        )
        trained = {
            "TP=2": models.compile_for_training(
                keras_tp.TensorParallelKeras(
                    models.language_model(**shape), world_size=2
                )
            ),
            "one device": models.compile_for_training(
                models.language_model(**shape)
            ),
        }
        for model in trained.values():
            # Every compilation happens in the first fit() calls.
            for _ in range(3):
                model.fit(**fit_args)

        def one_epoch(model):
            start = time.perf_counter()
            model.fit(**fit_args)
            return (time.perf_counter() - start) / steps

        times = interleaved(
            {name: (lambda m=m: one_epoch(m)) for name, m in trained.items()},
            repeats,
        )
        tp = trained["TP=2"]
        # The median of several profiled epochs: one burst of load on the
        # machine does not decide the share.
        profiles = [
            communication_share(lambda: tp.fit(**fit_args), devices=2)
            for _ in range(repeats)
        ]
        profiles.sort(key=lambda p: p["share"])
        share = profiles[len(profiles) // 2]
        memory = jax_steps.step_memory(
            jax_steps.compiled_train_step(tp, x[:batch], y[:batch])
        )
        stats = tp.communication_stats()
        sweep.append(
            {
                "hidden": hidden,
                "step_seconds": times,
                "step_ratio": ratio(times, "TP=2", "one device"),
                "tp_step_seconds": spread(times["TP=2"]),
                "communication_share": share,
                "peak_bytes": memory["peak"],
                "step_memory": memory,
                "collective_bytes": sum(k["bytes"] for k in stats.values()),
            }
        )
        progress((index + 1) / len(hidden_sizes))

    rows = []
    for entry in sweep:
        hidden = entry["hidden"]
        rows.append(
            comparison(
                f"jax TP=2, hidden {hidden}: training step",
                "one device, same cores",
                entry["step_ratio"],
            )
        )
        rows.append(
            comparison(
                f"jax TP=2, hidden {hidden}: communication share of op time",
                "all ops in the profile",
                100 * entry["communication_share"]["share"],
                unit="%",
            )
        )
    first, last = sweep[0], sweep[-1]
    falling = all(
        a["communication_share"]["share"] > b["communication_share"]["share"]
        for a, b in zip(sweep, sweep[1:])
    )
    rows.append(
        comparison(
            f"jax TP=2: communication share at hidden {last['hidden']}",
            f"at hidden {first['hidden']}",
            last["communication_share"]["share"]
            / first["communication_share"]["share"],
            goal=("<=", 1.0),
            note="falls at every step of the sweep"
            if falling
            else "not monotonic over the sweep",
        )
    )
    return {
        "rows": rows,
        "data": {
            "model": dict(
                blocks=blocks,
                heads=heads,
                seq_len=seq_len,
                vocab=vocab,
                batch=batch,
            ),
            "sweep": sweep,
        },
    }


def communication_share(run_steps, devices):
    """Fraction of the devices' op time spent moving data in collectives.

    Runs `run_steps` under `jax.profiler` and reads the trace: each HLO op
    XLA's CPU runtime executed is an event on a device thread. A
    collective also waits for the last device to arrive, and on shared
    cores that wait is mostly the other device computing; so each
    collective counts for the shortest time any device spent in it (the
    last device to arrive does not wait), on every device.

    Args:
        run_steps: callable running the profiled training steps.
        devices: the number of devices taking part in each collective.

    Returns:
        `{"share", "share_with_waits", "collective_ms", "all_ops_ms",
        "ops"}`: `ops` are the costliest collective ops, in ms.
    """
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            run_steps()
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
        events = collections.defaultdict(list)
        total = 0
        for plane in profile.planes:
            for line in plane.lines:
                if line.name == "python":
                    continue  # Python's own frames, not device work.
                for event in line.events:
                    if not HLO_OP.match(event.name):
                        continue
                    total += event.duration_ns
                    if COLLECTIVE_OP.search(event.name):
                        events[event.name].append(
                            (event.start_ns, event.duration_ns)
                        )
    moving = collections.Counter()
    waiting = 0
    for name, calls in events.items():
        calls.sort()
        waiting += sum(duration for _, duration in calls)
        # The devices' events of one call are adjacent in time.
        for i in range(0, len(calls) - devices + 1, devices):
            group = calls[i : i + devices]
            moving[name] += devices * min(d for _, d in group)
    moved = sum(moving.values())
    return {
        "share": moved / total if total else 0.0,
        "share_with_waits": waiting / total if total else 0.0,
        "collective_ms": moved / 1e6,
        "all_ops_ms": total / 1e6,
        "ops": {k: v / 1e6 for k, v in moving.most_common(8)},
    }
