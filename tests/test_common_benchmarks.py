"""The benchmark suite runs: `python -m benchmarks --quick` on one item.

Not a measurement (the sizes are tiny): it checks that a worker process
starts, measures, and that the suite writes its JSON record and Markdown
table with the fields the docs quote. Run alone:
`KERAS_BACKEND=jax python -m pytest tests/test_common_benchmarks.py`.
"""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
# Item 1 on JAX: one worker process, timing, HLO and memory analysis. It
# takes about 30 s alone; the limit only catches a hung worker, with room
# for a CI machine that runs two test workers on two cores.
BUDGET_SECONDS = 300


def test_quick_suite_writes_json_and_markdown(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--only",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUDGET_SECONDS,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    (record,) = tmp_path.glob("*.json")
    (table,) = tmp_path.glob("*.md")
    assert record.stem == table.stem
    doc = json.loads(record.read_text())
    assert {"date", "device", "machine", "versions", "command"} <= set(doc)
    assert doc["quick"] is True
    assert list(doc["items"]) == ["1"]
    (task,) = doc["items"]["1"]["tasks"]
    assert task["status"] == "ok"
    rows = task["rows"]
    assert rows, "item 1 measured nothing"
    for row in rows:
        assert {"what", "against", "median", "q1", "q3", "goal", "met"} <= set(
            row
        )
        assert row["median"] > 0
    data = task["data"]
    assert data["hlo_collectives"]["keras_tp"]["all-reduce"]["tensors"] > 0
    assert data["step_memory"]["keras_tp"]["peak"] > 0
    text = table.read_text()
    assert "| # | what | against | measured |" in text
    assert "keras_tp TP=2: training step" in text
    assert "| 1, 2, 3, 5 | on a GPU |" in text


# `benchmarks.gpu --cpu-smoke` on JAX: one worker process runs the four
# JAX measurements at tiny sizes (about 160 s on 2 shared cores, most of it
# compiling eight small models), then the JSON and Markdown records.
GPU_SMOKE_SECONDS = 600


def test_gpu_benchmark_cpu_smoke_writes_json_and_markdown(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--cpu-smoke",
            "--backends",
            "jax",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=GPU_SMOKE_SECONDS,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    (record,) = tmp_path.glob("*-smoke.json")
    (table,) = tmp_path.glob("*-smoke.md")
    assert record.stem == table.stem
    doc = json.loads(record.read_text())
    assert doc["smoke"] is True and doc["gpu_seen_by"] == {"jax": None}
    (task,) = doc["tasks"]
    assert task["status"] == "ok"
    parts = {row["part"] for row in task["rows"]}
    assert parts == {
        "world_size=1 vs plain fit",
        "mixed precision vs float32",
        "GPT2 model FLOPs utilisation",
        "keras_tp vs ModelParallel, TP=1",
    }
    for row in task["rows"]:
        assert row["median"] > 0, row
    gpt2 = task["data"]["GPT2 model FLOPs utilisation"]
    assert gpt2["flops_per_step"] > 6 * gpt2["parameters"] * 2 * 16
    text = table.read_text()
    assert "CPU smoke sizes: not a measurement." in text
    assert "| mixed precision vs float32 | jax: mixed_bfloat16" in text
