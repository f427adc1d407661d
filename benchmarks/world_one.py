"""Item 2: what wrapping costs, `TensorParallelKeras(model, world_size=1)`.

With one rank nothing is split, so the wrapped model should train as fast
as the plain one: any difference is keras_tp's own overhead per step (its
step wrapper, its regions, its runtime's scope). Both train the same LM
with the same data in one process of the chosen backend, interleaved, and
each keeps the `jit_compile` its `compile()` chooses by default.
"""

import time

import keras

import keras_tp
from benchmarks.models import compile_for_training
from benchmarks.models import language_data
from benchmarks.models import language_model
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio


def run(progress, dim, blocks, heads, seq_len, vocab, batch, steps, repeats):
    """Times plain `fit()` against `fit()` of the one-rank wrapper.

    Args:
        progress: callable taking the fraction of the work done.
        dim, blocks, heads, seq_len, vocab: the LM's shape.
        batch: batch size.
        steps: training steps per timed `fit()` epoch.
        repeats: timed rounds.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    shape = dict(dim=dim, blocks=blocks, heads=heads, seq_len=seq_len)
    x, y = language_data(batch * steps, seq_len, vocab)
    models = {
        "plain": language_model(vocab=vocab, **shape),
        "keras_tp": keras_tp.TensorParallelKeras(
            language_model(vocab=vocab, **shape), world_size=1
        ),
    }
    first_fit = {}
    for name, model in models.items():
        compile_for_training(model)
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        first_fit[name] = time.perf_counter() - start

    def one_epoch(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    times = interleaved(
        {
            name: (lambda m=model: one_epoch(m))
            for name, model in models.items()
        },
        repeats,
        warmup=1,
        progress=progress,
    )
    backend = keras.backend.backend()
    return {
        "rows": [
            comparison(
                f"{backend}: TensorParallelKeras(world_size=1) training step",
                f"plain model.fit ({backend})",
                ratio(times, "keras_tp", "plain"),
                goal=("<=", 1.02),
                note=(
                    "jit_compile as compile() chose it: plain "
                    f"{models['plain'].jit_compile}, keras_tp "
                    f"{models['keras_tp'].jit_compile}"
                ),
            )
        ],
        "data": {
            "backend": backend,
            "model": dict(shape, vocab=vocab, batch=batch),
            "step_seconds": times,
            "first_fit_seconds": first_fit,
            "jit_compile": {n: m.jit_compile for n, m in models.items()},
        },
    }
