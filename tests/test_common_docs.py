"""The MkDocs site builds with --strict, and lists every error keras_tp raises.

Backend-neutral: the API reference is read from the sources statically.
Run alone: `python -m pytest tests/test_common_docs.py`.
"""

import ast
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (site / "api" / "index.html").read_text()
    for name in (
        "keras_tp.model.TensorParallelKeras",
        "keras_tp.plan.sharding_plan.ShardingPlan",
        "keras_tp.plan.auto.auto_plan",
        "keras_tp.runtime.configure_virtual_devices",
        "keras_tp.launcher.launch",
        "keras_tp.collectives",
    ):
        assert name in api
    # Docstrings were rendered, not just the names.
    assert "Runs a built Keras model with its layers split across" in api


def raised_messages():
    """`(file:line, longest literal piece)` of each raise with a message.

    The longest constant piece of the message (the text between f-string
    fields) is what the troubleshooting page must quote verbatim.
    """
    found = []
    for path in sorted((REPO / "keras_tp").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and node.exc is not None):
                continue
            call = node.exc
            if not (isinstance(call, ast.Call) and call.args):
                continue
            pieces = _literal_pieces(call.args[0])
            if pieces:
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                found.append((where, max(pieces, key=len).strip()))
    return found


def _literal_pieces(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [
            value.value
            for value in node.values
            if isinstance(value, ast.Constant)
        ]
    return []


def test_troubleshooting_lists_every_error_message():
    page = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
    messages = raised_messages()
    assert len(messages) > 20
    missing = [
        f"{where}: {piece!r}"
        for where, piece in messages
        if " ".join(piece.split()) not in page
    ]
    assert not missing, "docs/troubleshooting.md lacks:\n" + "\n".join(missing)


def test_support_matrix_is_the_one_config_writes():
    from keras_tp import config

    api = (REPO / "docs" / "api.md").read_text()
    start = "<!-- support-matrix:start -->\n"
    end = "\n<!-- support-matrix:end -->"
    documented = api[api.index(start) + len(start) : api.index(end)]
    assert documented == config.support_table()
    # The refusals written from the matrix are quoted on the
    # troubleshooting page as they read.
    page = " ".join((REPO / "docs" / "troubleshooting.md").read_text().split())
    for feature in (
        "sequence_parallel",
        "sequence_parallel in pipeline stages",
    ):
        assert config.support_text(feature) in page
        assert config.fixes_text(feature) in page


def test_kubernetes_manifest_runs_train_py_through_torchrun():
    import yaml

    manifest = yaml.safe_load(
        (REPO / "docs" / "examples" / "trainjob.yaml").read_text()
    )
    assert manifest["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert manifest["kind"] == "TrainJob"
    assert manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = manifest["spec"]["trainer"]
    assert trainer["command"] == ["torchrun", "train.py"]
    assert {"name": "KERAS_BACKEND", "value": "torch"} in trainer["env"]
    gpus = trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]
    assert trainer["numProcPerNode"] == gpus
    # The SLURM recipe runs the same script.
    recipe = (REPO / "docs" / "examples" / "slurm_torch.sbatch").read_text()
    assert recipe.rstrip().endswith("train.py")
