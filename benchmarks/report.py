"""The suite's record: one JSON document, a Markdown table and plots."""

import datetime
import importlib.metadata
import os
import pathlib
import platform
import shutil

# The issue's table, for the items' headings.
GOALS = {
    1: "step <= 0.95x, compile <= 1.0x ModelParallel",
    2: "<= 1.02x plain model.fit",
    3: "<= 1.0x PyTorch parallelize_module",
    4: "report; DDP <= 1.05x MirroredStrategy",
    5: "<= 1.03x ideal; ZeRO within 3% of the formulas",
    6: "equal to Megatron / DDP / ZeRO counts",
    7: "plot; the communication share falls",
    8: "plot of calls and step time against bucket_cap_mb",
    9: "async and local SGD <= 1.0x DDP to a target loss; loss within 10%",
}
# Items the issue wants on GPUs too.
GPU_ITEMS = (1, 2, 3, 5)


def machine():
    """What the measurements ran on, read from this machine."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": shutil.which("nvidia-smi") is not None,
        "python": platform.python_version(),
    }


def versions():
    """Versions of Keras, the backends and keras-hub, as installed."""
    found = {}
    for name in ("keras", "jax", "torch", "tensorflow", "keras-hub"):
        for distribution in (name, f"{name}-cpu"):
            try:
                found[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def device_name(host):
    """A short name of the device for file names, e.g. `cpu-2core`."""
    return f"cpu-{host['cores']}core"


def document(outcomes, command, quick, wall_seconds, titles):
    """The results of one run of the suite, as a JSON-able dict.

    Args:
        outcomes: the tasks as `benchmarks.runner.run_task` returned them.
        command: the command line that ran the suite.
        quick: whether the sizes were the smoke-test ones.
        wall_seconds: the whole run's wall time.
        titles: `{item number: title}` of the items that ran.
    """
    host = machine()
    items = {}
    for number, title in titles.items():
        tasks = [o for o in outcomes if o["item"] == number]
        items[str(number)] = {
            "title": title,
            "goal": GOALS[number],
            "tasks": tasks,
        }
    gpu_note = (
        "not run: no GPU in this session"
        if not host["gpu"]
        else "not run: the suite has no GPU variant of these items yet"
    )
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(host),
        "machine": host,
        "versions": versions(),
        "command": command,
        "quick": quick,
        "wall_seconds": wall_seconds,
        "items": items,
        "gpu": {"items": list(GPU_ITEMS), "status": gpu_note},
    }


def markdown(doc):
    """The results table, one row per comparison, in Markdown."""
    host = doc["machine"]
    lines = [
        f"Measured {doc['date']} on {host['cpu']} ({host['cores']} cores, "
        f"{doc['device']}), "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
        + f"; `{doc['command']}`, {doc['wall_seconds'] / 60:.1f} min."
        + (" Quick (smoke-test) sizes." if doc["quick"] else ""),
        "",
        "Every ratio is the median of per-round ratios of two runs timed "
        "in the same process, interleaved; the range is the interquartile "
        "range over the rounds.",
        "",
        "| # | what | against | measured | range | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, item in doc["items"].items():
        for task in item["tasks"]:
            if task["status"] != "ok":
                lines.append(
                    f"| {number} | {task['label']} | | {task['status']} "
                    "| | | no |"
                )
                continue
            for row in task["rows"]:
                lines.append(_row(number, row))
    gpu = doc["gpu"]
    items = ", ".join(str(n) for n in gpu["items"])
    lines.append(f"| {items} | on a GPU | | {gpu['status']} | | | |")
    notes = [
        f"- {number}: {row['what']}: {row['note']}"
        for number, item in doc["items"].items()
        for task in item["tasks"]
        for row in task.get("rows", [])
        if row.get("note")
    ]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def _row(number, row):
    unit = row["unit"]
    value = _format(row["median"], unit)
    if row["repeats"] > 1:
        spread = (
            f"{_format(row['q1'], unit)}–{_format(row['q3'], unit)} "
            f"({row['repeats']} rounds)"
        )
    else:
        spread = ""
    met = {True: "yes", False: "**no**", None: ""}[row["met"]]
    goal = row["goal"] or "report"
    return (
        f"| {number} | {row['what']} | {row['against']} | {value} "
        f"| {spread} | {goal} | {met} |"
    )


def _format(value, unit):
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "bytes":
        return f"{value:,.0f} B"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "%":
        return f"{value:.1f}%"
    return f"{value:g} {unit}".strip()


def write(doc, out_dir):
    """Writes `<date>-<device>.json`, `.md` and the plots into `out_dir`.

    Returns:
        The paths written.
    """
    import json

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{doc['date']}-{doc['device']}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(markdown(doc))
    from benchmarks import plots

    for number, item in doc["items"].items():
        draw = plots.PLOTS.get(int(number))
        tasks = [t for t in item["tasks"] if t["status"] == "ok"]
        if draw is not None and tasks:
            path = pathlib.Path(f"{stem}-item{number}.png")
            draw(tasks, path, f"{doc['date']}, {doc['device']}")
            paths.append(path)
    return paths
