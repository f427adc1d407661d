"""The `keras-tp` command line: `plan` and `demo`, in process and as a program.

Backend-neutral: `plan` needs no devices. The commands of the README, the
docs and `--help` run as written in `test_common_examples.py`. Run alone:
`KERAS_BACKEND=jax python -m pytest tests/test_common_cli.py`.
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

import keras_tp
from keras_tp import cli
from keras_tp.demo.models import transformer_lm
from keras_tp.plan.memory import zero_memory
from keras_tp.tensors import nbytes

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    """The demo's transformer LM (dim 16, 4 heads, vocab 64), saved."""
    path = tmp_path_factory.mktemp("cli") / "lm.keras"
    transformer_lm().save(path)
    return str(path)


def run_cli(*args):
    """Runs `python -m keras_tp.cli` on this checkout; returns the result."""
    env = {
        **os.environ,
        "KERAS_BACKEND": keras.backend.backend(),
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        [sys.executable, "-m", "keras_tp.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(stderr):
    """The CLI's own lines on stderr (a backend may log there too)."""
    return [line for line in stderr.splitlines() if "keras-tp" in line]


def trainable_bytes_per_rank(model, tensor_parallel):
    """P: trainable bytes one rank holds, from the plan's split axes."""
    split = dict(keras_tp.auto_plan(model, tensor_parallel).variable_axes())
    total = 0
    for variable in model.trainable_variables:
        shape = list(variable.shape)
        if variable.path in split:
            shape[split[variable.path][1]] //= tensor_parallel
        total += nbytes(variable, shape)
    return total


def memory_row(output, label):
    """The four numbers of a row of the memory table, as ints."""
    for line in output.splitlines():
        if line.startswith(label):
            fields = line[len(label) :].split()
            return [int(field.replace(",", "")) for field in fields[:4]]
    raise AssertionError(f"no row {label!r} in:\n{output}")


def test_entry_point_is_declared():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '[project.scripts]\nkeras-tp = "keras_tp.cli:main"' in pyproject


def test_plan_prints_styles_local_shapes_and_zero_memory(saved_lm, capsys):
    status = cli.run(
        [
            "plan",
            saved_lm,
            "--world-size",
            "8",
            "--data-parallel",
            "2",
            "--zero-stage",
            "1",
        ]
    )
    output = capsys.readouterr().out
    assert status == 0
    assert "data parallel 2 x tensor parallel 4" in output
    header = output.splitlines()[0]
    assert f"backend {keras.backend.backend()} (" in header
    assert "choose one with --backend or KERAS_BACKEND" in header
    # Per layer: style and the local shape at 4 tensor-parallel ranks.
    lines = {line.split()[0]: line for line in output.splitlines() if line}
    assert "Vocab()" in lines["token_embedding/embeddings"]
    assert "(16, 16)" in lines["token_embedding/embeddings"]  # 64 / 4 rows
    query = lines["block0_attention/query/kernel"]
    assert "Column(gather_output=False)" in query and "(16, 1, 4)" in query
    mlp_down = lines["block1_mlp_down/kernel"]
    assert "Row(input_is_parallel=True)" in mlp_down
    assert "(16, 16)" in mlp_down  # 64 hidden / 4
    assert "Column(gather_output=True)" in lines["lm_head/kernel"]
    assert "block0_ln1 (128 B): LayerNormalization" in output
    # Memory: the ZeRO formulas with P per tensor-parallel rank and D = 2.
    model = keras.saving.load_model(saved_lm)
    p = trainable_bytes_per_rank(model, 4)
    assert f"P = {p:,} B" in output
    expected = {
        "0 (off)": [p, p, 2 * p],
        "1 ": [p, p, p],
        "2 ": [p, p // 2, p],
        "3 ": [p // 2, p // 2, p],
    }
    for label, (params, grads, adam) in expected.items():
        assert memory_row(output, label) == [
            params,
            grads,
            adam,
            params + grads + adam,
        ]
    full = sum(nbytes(v) for v in model.trainable_variables)
    assert memory_row(output, "one device") == [full, full, 2 * full, 4 * full]
    marked = [line for line in output.splitlines() if "<- --zero-stage" in line]
    assert len(marked) == 1 and marked[0].startswith("1 ")


def test_plan_bytes_match_what_tensor_parallel_keras_measures(saved_lm, capsys):
    """The CLI's arithmetic equals the bytes read from the sharded arrays."""
    if len(keras.distribution.list_devices()) < 4:
        pytest.skip("needs 4 devices (run_all.sh configures 4 on JAX)")
    assert cli.run(["plan", saved_lm, "--world-size", "4"]) == 0
    output = capsys.readouterr().out
    tp = keras_tp.TensorParallelKeras(
        keras.saving.load_model(saved_lm), world_size=4
    )
    measured = set(tp.parameter_bytes_per_device().values())
    assert len(measured) == 1
    assert memory_row(output, "0 (off)")[0] == measured.pop()


def test_zero_memory_formulas():
    p, d = 1200, 4
    assert zero_memory(p, 0, d, 0) == {
        "parameters": p,
        "gradients": p,
        "adam": 2 * p,
        "total": 4 * p,
        "between_steps": 3 * p,
    }
    assert zero_memory(p, 0, d, 1)["total"] == p + p + 2 * p // d
    assert zero_memory(p, 0, d, 2)["total"] == p + p // d + 2 * p // d
    assert zero_memory(p, 0, d, 3)["total"] == (p + p + 2 * p) // d
    # What a CoordinatedOptimizer keeps between steps: no gradients.
    assert zero_memory(p, 0, d, 2)["between_steps"] == p + 2 * p // d
    # Frozen variables: no gradient, no Adam state, never partitioned.
    assert zero_memory(p, 100, d, 3)["parameters"] == p // d + 100


def test_allow_replicated_lists_the_layers_left_whole(saved_lm, capsys):
    status = cli.run(
        ["plan", saved_lm, "--world-size", "8", "--allow-replicated"]
    )
    output = capsys.readouterr().out
    assert status == 0
    assert (
        "block0_attention (4,352 B): 4 query and 4 key/value heads do not "
        "divide by tensor_parallel=8" in output
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--world-size", "3"],
            "--world-size 3 gives tensor-parallel size 3, which does not "
            "divide the dimensions of 9 layer(s) of 'transformer_lm'",
        ),
        (
            ["--world-size", "6", "--data-parallel", "4"],
            "--world-size 6 is not divisible by --data-parallel 4",
        ),
    ],
)
def test_plan_errors_are_one_line(saved_lm, capsys, args, message):
    assert cli.run(["plan", saved_lm, *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("keras-tp plan: error: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_plan_refuses_a_file_keras_cannot_load(tmp_path, capsys):
    not_a_model = tmp_path / "notes.keras"
    not_a_model.write_text("not a zip file")
    assert cli.run(["plan", str(not_a_model), "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"keras-tp plan: error: cannot load {not_a_model}")
    assert err.count("\n") == 1


def test_usage_errors_exit_2(saved_lm, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.run(["plan", saved_lm])  # --world-size is required
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.run(["plan", saved_lm, "--world-size", "0"])
    assert exit_info.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], ["plan", "demo"]),
        (["plan"], ["--world-size", "--data-parallel", "--zero-stage"]),
        (["demo"], ["--backend", "--devices"]),
    ],
)
def test_help(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.run([*args, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(option in text for option in expected)
    assert "\nexamples:\n  keras-tp " in text


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"]])
def test_help_imports_no_backend_and_writes_nothing_on_stderr(args):
    """`--help` answers at once: Keras and the backends load on first use."""
    code = (
        "import sys\n"
        "from keras_tp import cli\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('keras', 'jax', 'torch', 'tensorflow')\n"
        "print('loaded:', [name for name in heavy if name in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: keras-tp" in result.stdout
    assert "loaded: []" in result.stdout
    assert result.stderr == ""


def test_one_backend_rule_for_every_command(monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert cli.choose_backend() == ("jax", "the default")
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert cli.choose_backend() == ("torch", "from KERAS_BACKEND")
    assert cli.choose_backend("tensorflow") == ("tensorflow", "from --backend")
    assert cli.describe_backend("jax", "the default") == (
        "backend jax (the default; choose one with --backend or KERAS_BACKEND)"
    )


def test_quiet_native_logs_drops_only_native_log_lines():
    """The programs' stderr filter, in this process and in its children."""
    native = [
        "WARNING: All log messages before absl::InitializeLog() is called "
        "are written to STDERR",
        "I0000 00:00:1795424013.569436   26970 port.cc:153] oneDNN custom "
        "operations are on.",
        "To enable the following instructions: AVX2 FMA, in other "
        "operations, rebuild TensorFlow with the appropriate compiler flags.",
        "W0000 00:00:1795424013.570001   26970 x.cc:7] a warning",
        "E0000 00:00:1795424049.008336   27394 cuda_platform.cc:52] failed "
        "call to cuInit: INTERNAL: CUDA error",
    ]
    kept = [
        "F0000 00:00:1795424049.008336   27394 x.cc:9] a fatal error",
        "UserWarning: a Python warning",
    ]
    child = (
        "import os; os.write(2, b'I0000 00:00:1.5 3 c.cc:1] info\\nchild\\n')"
    )
    code = (
        "import os, subprocess, sys\n"
        "from keras_tp import cli\n"
        "cli.quiet_native_logs()\n"
        f"for line in {native + kept!r}:\n"
        "    os.write(2, (line + '\\n').encode())\n"
        f"subprocess.run([sys.executable, '-c', {child!r}])\n"
        "print('from print', file=sys.stderr)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [*kept, "child", "from print"]

    # TF_CPP_MIN_LOG_LEVEL=0 asks for every line.
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stderr.splitlines()[: len(native)] == native


def test_importing_keras_tp_leaves_the_environment_alone():
    """Only the programs' `main()` set variables or filter stderr."""
    code = (
        "import os\n"
        "before = dict(os.environ), os.fstat(2)\n"
        "import keras_tp, keras_tp.cli, keras_tp.demo.__main__\n"
        "assert (dict(os.environ), os.fstat(2)) == before\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_demo_forwards_its_options(monkeypatch):
    commands = []
    monkeypatch.setattr(
        cli.subprocess, "call", lambda command: commands.append(command) or 0
    )
    argv = ["demo", "--backend", "jax", "--devices", "2", "--save", "lm.keras"]
    assert cli.run(argv) == 0
    assert commands == [[sys.executable, "-m", "keras_tp.demo", *argv[1:]]]


def test_program_plan_and_bad_path(saved_lm):
    result = run_cli("plan", saved_lm, "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert "tensor parallel 2" in result.stdout
    assert "ZeRO stage" in result.stdout

    result = run_cli("plan", "missing.keras", "--world-size", "2")
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        "keras-tp plan: error: no such file: missing.keras"
    ]
    assert "Traceback" not in result.stderr


def test_plan_on_another_backend_runs_a_fresh_interpreter(
    saved_lm, monkeypatch
):
    other = "torch" if keras.backend.backend() != "torch" else "jax"
    calls = []
    monkeypatch.setattr(
        cli.subprocess,
        "call",
        lambda command, env: calls.append((command, env)) or 0,
    )
    argv = ["plan", saved_lm, "--world-size", "2", "--backend", other]
    assert cli.run(argv) == 0
    [(command, env)] = calls
    assert command == [sys.executable, "-m", "keras_tp.cli", *argv]
    assert env["KERAS_BACKEND"] == other
