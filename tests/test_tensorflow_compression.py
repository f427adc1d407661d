"""Gradient compression over the data axis on TensorFlow (4 replicas).

Run alone: `KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_compression.py`. Exact bytes per kind, bf16/fp16
close to uncompressed, the compression state through a checkpoint, and
ZeRO-3 refused; the convergence margins are checked on JAX.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import compression_cases as cases  # noqa: E402

# Fewer runs than on JAX: tracing a TensorFlow step takes seconds.
LAYOUTS = {
    (2, 2, 0): ("fp16", "powersgd", "sign"),
    (2, 2, 2): ("bf16",),
    (4, 2, 1): ("powersgd",),
}


def test_bytes_and_closeness():
    runs = {
        (kind, layout): cases.train(kind, layout)
        for layout, kinds in LAYOUTS.items()
        for kind in (None,) + kinds
    }
    cases.check_traffic_and_closeness(runs)


def test_state_resumes_from_checkpoint(tmp_path):
    for kind in ("powersgd", "sign"):
        # The lost-state control runs on JAX and torch: a TensorFlow
        # variable split over replicas cannot be assigned from outside.
        losses = cases.resume_run(kind, str(tmp_path / kind), (2, 2, 0))
        cases.check_resumed(*losses)


def test_zero3_is_refused():
    cases.check_zero3_message(cases.zero3_refused())


def test_warmup_sends_uncompressed_then_compressed():
    for kind in ("powersgd", "sign"):
        cases.check_warmup(kind, cases.warmup_run(kind))


def test_signs_of_the_momentum_keep_adams_second_moment():
    cases.check_momentum_signs(cases.momentum_signs_run("adam"))
