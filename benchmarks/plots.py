"""Plots of the items that sweep a size: 7 (hidden width), 8 (buckets).

Each function takes the item's finished tasks, a path and a subtitle (date
and device) and writes one small PNG with matplotlib's Agg backend, so no
display is needed.
"""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scaling(tasks, path, subtitle):
    """Item 7: step time, peak memory and communication share by width."""
    plt = _pyplot()
    sweep = tasks[0]["data"]["sweep"]
    hidden = [entry["hidden"] for entry in sweep]
    figure, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    axes[0].plot(
        hidden, [e["step_ratio"]["median"] for e in sweep], "o-", label="median"
    )
    axes[0].fill_between(
        hidden,
        [e["step_ratio"]["q1"] for e in sweep],
        [e["step_ratio"]["q3"] for e in sweep],
        alpha=0.3,
        label="IQR",
    )
    axes[0].set_title("TP=2 step time / one device")
    axes[0].legend()
    axes[1].plot(hidden, [e["peak_bytes"] / 2**20 for e in sweep], "o-")
    axes[1].set_title("peak memory per device (MiB)")
    axes[2].plot(
        hidden, [100 * e["communication_share"]["share"] for e in sweep], "o-"
    )
    axes[2].set_title("communication share of op time (%)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(hidden, [str(h) for h in hidden])
        ax.set_xlabel("hidden")
        ax.grid(alpha=0.3)
    figure.suptitle(f"keras_tp JAX TP=2 as the LM widens ({subtitle})")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def buckets(tasks, path, subtitle):
    """Item 8: all-reduce calls and step time against `bucket_cap_mb`."""
    plt = _pyplot()
    data = tasks[0]["data"]
    caps = data["bucket_cap_mb"]
    rows = tasks[0]["rows"]
    figure, (calls_ax, time_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
    calls_ax.plot(caps, data["all_reduce_calls"], "o-")
    calls_ax.set_title("all-reduce calls per step")
    time_ax.plot(caps, [row["median"] for row in rows], "o-", label="median")
    time_ax.fill_between(
        caps,
        [row["q1"] for row in rows],
        [row["q3"] for row in rows],
        alpha=0.3,
        label="IQR",
    )
    time_ax.axhline(1.0, color="grey", linewidth=0.8)
    time_ax.set_title("step time / bucket_cap_mb=25")
    time_ax.legend()
    for ax in (calls_ax, time_ax):
        ax.set_xscale("log")
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
        ax.set_xlabel("bucket_cap_mb")
        ax.grid(alpha=0.3)
    figure.suptitle(
        f"torch DDP=2, {data['gradient_mb']:.0f} MB of gradients ({subtitle})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


PLOTS = {7: scaling, 8: buckets}
