"""The examples of README.md, docs/ and `keras-tp --help` run as written.

An example is a fenced `bash` or `python` block of README.md or docs/, a
fenced `text` block whose first line is a command after `$ ` (the lines
after it are the output the command prints), or a command that
`keras-tp --help`, `keras-tp plan --help` or `keras-tp demo --help` lists
under `examples:`. Each one runs here unless `NOT_RUN` names it and
says why.

Commands run in a fresh directory, without `KERAS_BACKEND` or
`TF_CPP_MIN_LOG_LEVEL`, as on a fresh install. Two substitutions: an install
before `&&` is skipped (this is the installed environment), and `keras-tp`
runs as `python -m keras_tp.cli` from this checkout (the installed entry
point may point to another copy). In expected output, a line `...` stands
for any lines, and a line ending in `...` for any line that starts with
what comes before.

Python blocks run on JAX in one process, each in a namespace holding what
the docs leave to the reader: `build_my_keras_model()` builds the demo's
transformer LM, `x` and `y` are its data, and `PYTHON_SETUP` defines what
else a block uses (`model`, `tp`).

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_common_examples.py`.
"""

import ast
import collections
import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import keras_tp
from keras_tp import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SNIPPET = re.compile(r'^--8<-- "(.+)"$')
# A line of TensorFlow's or XLA's C++ logs, which the programs keep quiet.
NATIVE_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog")

Example = collections.namedtuple("Example", ["where", "kind", "text"])

# Examples not run here, by page and first line, with the reason.
NOT_RUN = {
    (
        "docs/guides/communication.md",
        "# the bucket size from a probe of the data axis",
    ): "tests/test_jax_dp.py::test_auto_bucket_size_is_measured_on_the_data_"
    "axis makes these calls (and the torch and TensorFlow DP tests)",
    (
        "docs/guides/communication.md",
        "# within each host first, then across hosts",
    ): "tests/test_jax_dp.py::test_hierarchical_on_one_host_reduces_in_one_"
    "level makes these calls on one host; tests/test_jax.py and "
    "tests/test_torch_dp.py on two",
    (
        "docs/guides/elastic.md",
        "# one node: after a failure every rank restarts, at the same size",
    ): "torchrun on 4 ranks and across nodes; tests/test_torch_elastic.py "
    "runs torchrun --nnodes=1:1 --max-restarts 1",
    ("README.md", 'pip install -e ".[all,dev]" && bash tests/run_all.sh'): (
        "the test suite itself"
    ),
    (
        "docs/comparison.md",
        "python benchmarks/compare_modelparallel.py --devices 4",
    ): "a benchmark: a minute on 2 cores, for a table in the docs",
    (
        "docs/guides/cli.md",
        "keras-tp plan MODEL.keras --world-size 4 "
        "[--data-parallel 2 --zero-stage 1]",
    ): "the synopsis, with placeholders; its example below runs",
    (
        "docs/guides/cli.md",
        "keras-tp demo [--backend jax|torch|tensorflow] [--devices N] "
        "[--epochs E] [--samples S] [--save PATH]",
    ): "the synopsis, with placeholders; its example below runs",
    ("docs/guides/jax.md", 'pip install -e ".[jax]"'): (
        "installs; the tests run in the installed environment"
    ),
    ("docs/guides/jax.md", "import keras"): (
        "names gpu:2 and gpu:3, so it needs 4 GPUs"
    ),
    ("docs/guides/jax.md", '--8<-- "docs/examples/jax_multihost.py"'): (
        "two processes and a coordinator port; tests/test_jax.py runs the "
        "same flow in tests/jax_scripts/multihost.py"
    ),
    ("docs/guides/clusters.md", "import keras"): (
        "needs a cluster's ranks; tests/test_torch_launcher.py trains this "
        "way under the SLURM recipe's command"
    ),
    ("docs/guides/clusters.md", "import ray.train"): (
        "a Ray cluster of workers; tests/test_torch_ray.py and "
        "tests/test_tensorflow_ray.py run these training functions and the "
        "callback under TorchTrainer and TensorflowTrainer"
    ),
    ("docs/guides/clusters.md", '--8<-- "docs/examples/slurm_torch.sbatch"'): (
        "srun and scontrol need a SLURM cluster; tests/test_torch_launcher.py "
        "runs the srun command on one node"
    ),
    ("docs/guides/jax.md", "keras_tp.configure_virtual_devices(4)"): (
        "DDP and ZeRO on JAX: tests/test_jax_dp.py and notebook 03 make these "
        "calls"
    ),
    ("docs/guides/notebooks.md", 'pip install -e ".[dev]"'): (
        "tests/test_common_notebooks.py runs every notebook"
    ),
    ("docs/guides/tensorflow.md", "import keras_tp"): (
        "a TensorFlow process (half a minute here): notebook 05 runs this "
        "training cell, tests/test_tensorflow.py checks it"
    ),
    ("docs/guides/tensorflow.md", "keras_tp.configure_virtual_devices(4)"): (
        "DDP and ZeRO on TensorFlow: tests/test_tensorflow_dp.py runs them"
    ),
    ("docs/guides/tensorflow.md", "export KERAS_BACKEND=tensorflow"): (
        "two hosts; tests/tf_scripts/multi_worker.py runs two workers on "
        "loopback ports"
    ),
    ("docs/guides/tensorflow.md", "# train.py"): (
        "the script of the two-host example above"
    ),
    ("docs/guides/torch.md", "import keras, keras_tp"): (
        "torch rank processes (half a minute here): notebook 04 runs this "
        "cell through keras_tp.launch, tests/test_torch.py checks launch"
    ),
    (
        "docs/guides/torch.md",
        "KERAS_BACKEND=torch torchrun --standalone --nproc-per-node 2 train.py",
    ): (
        "runs the reader's train.py; tests/test_torch.py runs torchrun on "
        "tests/torch_scripts/train_smoke.py"
    ),
    (
        "docs/guides/torch.md",
        "KERAS_BACKEND=torch torchrun --nnodes 2 --nproc-per-node 8 \\",
    ): "two nodes",
    ("docs/guides/torch.md", "def train():"): (
        "DDP and ZeRO on torch: tests/test_torch_dp.py runs them"
    ),
    ("docs/guides/mpi.md", "KERAS_BACKEND=torch mpirun -n 4 python train.py"): (
        "runs the reader's train.py on 4 ranks; tests/test_torch_mpi.py and "
        "tests/test_jax_mpi.py run mpirun -n 2 on their scripts"
    ),
    (
        "docs/guides/mpi.md",
        "sudo apt-get install -y --no-install-recommends openmpi-bin",
    ): "installs; .ci/run installs Open MPI and mpi4py",
    (
        "docs/guides/mpi.md",
        "mpirun -H node0:8,node1:8 -n 16 -x KERAS_BACKEND=torch \\",
    ): "two nodes",
    (
        "docs/guides/mpi.md",
        "KERAS_BACKEND=jax mpirun --oversubscribe -n 2 python train_jax.py",
    ): "runs the reader's script; tests/test_jax_mpi.py runs the same flow "
    "in tests/jax_scripts/mpi_train.py",
    ("docs/guides/mpi.md", "# train_jax.py, its first lines"): (
        "a process of its own: tests/jax_scripts/mpi_train.py starts so"
    ),
    (
        "docs/guides/mpi.md",
        "KERAS_BACKEND=torch python -m pytest -q tests/test_torch_mpi.py",
    ): "the tests themselves, which the suite runs",
}
# What a Python block uses without defining it, besides
# `build_my_keras_model`, `x` and `y`.
MODEL = "model = build_my_keras_model()\n"
PYTHON_SETUP = {
    (
        "docs/guides/jax.md",
        "plan = keras_tp.auto_plan(model, tensor_parallel=4)",
    ): (MODEL),
    (
        "docs/guides/jax.md",
        "tp = keras_tp.TensorParallelKeras(model, world_size=4, plan={",
    ): MODEL,
    (
        "docs/troubleshooting.md",
        "tp = keras_tp.TensorParallelKeras(model, world_size=2, "
        "sample_batch=x[:2])",
    ): MODEL,
    ("docs/guides/jax.md", "tp.summary()"): (
        MODEL + "tp = keras_tp.TensorParallelKeras(model, world_size=4)\n"
        "tp.compile(optimizer='adam', loss='mse')\n"
        "tp.fit(x, keras.ops.one_hot(y, 64), epochs=1, verbose=0)\n"
    ),
}
# The names the generation example of docs/models.md leaves to the reader:
# a tiny Llama backbone, its training data, and prompts padded to length 8.
PYTHON_SETUP[
    (
        "docs/models.md",
        "causal_lm = keras_hub.models.LlamaCausalLM(backbone, "
        "preprocessor=None)",
    )
] = (
    "import keras_hub\n"
    "import numpy as np\n"
    "backbone = keras_hub.models.LlamaBackbone(vocabulary_size=64, "
    "num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, "
    "intermediate_dim=32)\n"
    "ids = np.random.default_rng(0).integers(1, 64, (2, 8)).astype('int32')\n"
    "mask = np.arange(8) < np.array([[3], [5]])\n"
    "x = {'token_ids': ids, 'padding_mask': np.ones_like(mask)}\n"
    "y = ids\n"
)
# Commands that end with an error on purpose, and their exit status.
FAILING_COMMANDS = {"keras-tp plan lm.keras --world-size 3": 1}


def doc_examples():
    """Every example block of README.md and docs/, in page order."""
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            kind, body = match.groups()
            if kind in ("bash", "python") or (
                kind == "text" and body.startswith("$ ")
            ):
                yield Example(str(page.relative_to(REPO)), kind, body)


def help_examples():
    """The commands under `examples:` in the help of `keras-tp`."""
    for command in ([], ["plan"], ["demo"]):
        help_text = help_of(command)
        listed = help_text.split("\nexamples:\n", 1)[1]
        where = " ".join(["keras-tp", *command, "--help"])
        for line in listed.splitlines():
            if line.startswith("  keras-tp "):
                yield Example(where, "bash", line.strip() + "\n")


def help_of(command):
    """What `keras-tp COMMAND --help` prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        cli.run([*command, "--help"])
    return printed.getvalue()


def label(example):
    """An example's first line, without its comment: its name in NOT_RUN."""
    return example.text.splitlines()[0].split("  #")[0].strip()


def not_run_reason(example):
    return NOT_RUN.get((example.where, label(example)))


def commands_of(example):
    """`(command, expected output lines)` of a bash or text example."""
    if example.kind == "text":
        command, *output = example.text.splitlines()
        return [(command[2:], output)]
    joined = example.text.replace("\\\n", " ")
    return [
        # An install before `&&`: this is the installed environment.
        (re.sub(r"^pip install [^&]*&& ", "", line.strip()), [])
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def all_examples():
    return [*doc_examples(), *help_examples()]


def test_not_run_names_only_examples_that_exist():
    shown = {(example.where, label(example)) for example in all_examples()}
    assert not set(NOT_RUN) - shown, "NOT_RUN names examples that are gone"


def test_readme_has_two_commands_install_and_demo_install_and_tests():
    readme = [e for e in doc_examples() if e.where == "README.md"]
    commands = [e.text.strip() for e in readme if e.kind == "bash"]
    assert commands == [
        'pip install -e ".[jax]" && python -m keras_tp.demo',
        'pip install -e ".[all,dev]" && bash tests/run_all.sh',
    ]


def command_cases():
    """Each command to run, once, with the outputs the examples show.

    In page order, so `keras-tp demo --save lm.keras` writes the file that
    the `keras-tp plan lm.keras` examples after it read.
    """
    cases = {}
    for example in all_examples():
        if example.kind == "python" or not_run_reason(example):
            continue
        for command, output in commands_of(example):
            cases.setdefault(command, [])
            if output:
                cases[command].append((example.where, output))
    return list(cases.items())


@pytest.fixture(scope="module")
def fresh_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


def run_as_written(command, directory):
    argv = shlex.split(command)
    if argv[0] == "keras-tp":
        argv = ["python", "-m", "keras_tp.cli", *argv[1:]]
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(name, None)
    return subprocess.run(
        argv,
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_shows(actual, expected, where):
    """`actual` lines hold `expected` in order, with its `...` elisions."""
    actual = [line.rstrip() for line in actual]
    position, skipping = 0, False
    for wanted in expected:
        if wanted == "...":
            skipping = True
            continue
        prefix = wanted[:-3] if wanted.endswith("...") else None
        while position < len(actual):
            line = actual[position]
            position += 1
            if line == wanted or (prefix and line.startswith(prefix)):
                break
            assert skipping, (
                f"{where}: expected\n  {wanted}\ngot\n  {line}\n"
                "in:\n" + "\n".join(actual)
            )
        else:
            pytest.fail(
                f"{where}: no line\n  {wanted}\nin:\n" + "\n".join(actual)
            )
        skipping = False


@pytest.mark.parametrize(
    "command, outputs", command_cases(), ids=[c for c, _ in command_cases()]
)
def test_command_runs_as_written(command, outputs, fresh_directory):
    result = run_as_written(command, fresh_directory)
    expected_status = FAILING_COMMANDS.get(command, 0)
    assert result.returncode == expected_status, result.stdout + result.stderr
    noise = [
        line
        for line in result.stderr.splitlines()
        if NATIVE_LOG_LINE.search(line)
    ]
    assert not noise, "native log lines on stderr:\n" + "\n".join(noise)
    printed = (result.stdout + result.stderr).splitlines()
    for where, output in outputs:
        assert_shows(printed, output, where)


def python_examples():
    """`(example, code)` of each Python block, its snippet files read."""
    for example in doc_examples():
        if example.kind != "python":
            continue
        code = example.text
        snippet = SNIPPET.match(code.strip())
        if snippet:
            code = (REPO / snippet.group(1)).read_text()
        yield example, code


def test_python_examples_compile_and_name_real_api():
    """Every Python block, run here or not, uses names keras_tp has."""
    for example, code in python_examples():
        for node in ast.walk(ast.parse(code, example.where)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "keras_tp"
            ):
                assert node.attr in keras_tp.__all__, (
                    f"{example.where}: keras_tp.{node.attr}"
                )
            if isinstance(node, ast.ImportFrom) and node.module.startswith(
                "keras_tp."
            ):
                defined = top_level_names(node.module)
                for alias in node.names:
                    assert alias.name in defined, (
                        f"{example.where}: {node.module}.{alias.name}"
                    )


def top_level_names(module):
    """Names a keras_tp module defines, read without importing it."""
    path = REPO.joinpath(*module.split("."))
    if path.is_dir():
        path = path / "__init__.py"
    names = set()
    for node in ast.parse(path.with_suffix(".py").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


RUNNER = """
import keras
import keras_tp
from keras_tp.demo.models import counting_sequences, transformer_lm

keras_tp.configure_virtual_devices(4)
x, y = counting_sequences(256)
for where, setup, code in BLOCKS:
    namespace = dict(
        keras=keras,
        keras_tp=keras_tp,
        build_my_keras_model=transformer_lm,
        x=x,
        y=y,
    )
    exec(setup, namespace)
    exec(compile(code, where, "exec"), namespace)
    print("ran", where, flush=True)
"""


def test_python_examples_run_on_jax(fresh_directory):
    blocks, seen = [], set()
    for example, code in python_examples():
        if not_run_reason(example):
            continue
        # README.md and docs/index.md show the same example.
        key = tuple(line for line in code.splitlines() if line.strip())
        if key in seen:
            continue
        seen.add(key)
        where = f"{example.where}: {label(example)}"
        setup = PYTHON_SETUP.get((example.where, label(example)), "")
        blocks.append((where, setup, code))
    script = f"BLOCKS = {blocks!r}\n{RUNNER}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KERAS_BACKEND": "jax"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=fresh_directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    ran = [
        line for line in result.stdout.splitlines() if line.startswith("ran ")
    ]
    assert ran == [f"ran {where}" for where, _, _ in blocks]
