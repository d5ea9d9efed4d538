"""`bench serve --plot`: latency percentiles, throughput and goodput against the load. Where latency
turns up and throughput flattens (the knee) is the server's capacity."""

from __future__ import annotations


def _positions(runs: list[dict]) -> tuple[list[float], list[str]]:
    """x of each load point, and its tick label ('inf' rates sit right of the finite ones)."""
    values = [r["load"]["value"] for r in runs]
    finite = [float(v) for v in values if v != "inf"]
    inf_x = max(finite) * 2 if finite else 1.0
    xs = [inf_x if v == "inf" else float(v) for v in values]
    return xs, ["inf" if v == "inf" else f"{float(v):g}" for v in values]


def plot_runs(runs: list[dict], path: str, title: str = "") -> None:
    import logging

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font-cache notices
    import matplotlib.pyplot as plt

    xs, labels = _positions(runs)
    mode = runs[0]["load"]["mode"]
    xlabel = "concurrency (requests in flight)" if mode == "concurrency" else "offered request rate (req/s)"
    single = len(runs) == 1
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    style = dict(marker="o", markersize=8 if single else 5)

    def series(ax, key, stat, label, color, ls="-"):
        ys = [r[key][stat] if key.endswith("_ms") else r[key] for r in runs]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not pts:
            return
        ax.plot(*zip(*pts), ls, color=color, label=label, **style)
        if single:  # one point says little by its position alone: print its value
            ax.annotate(f"{pts[0][1]:.3g}", pts[0], textcoords="offset points", xytext=(8, 4), color=color)

    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        series(ax, key, "median", f"{name} p50", "tab:blue")
        series(ax, key, "p99", f"{name} p99", "tab:red", "--")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles")
    ax = axes[2]
    series(ax, "request_throughput", None, "throughput (req/s)", "tab:green")
    if runs[0]["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in runs[0]["slo_ms"].items())
        series(ax, "goodput", None, f"goodput ({slo})", "tab:purple", "--")
    ax.set_ylabel("requests/s")
    ax.set_title("throughput and goodput")
    tok = ax.twinx()  # output tokens/s on its own scale, lighter
    tok.plot(xs, [r["output_token_throughput"] for r in runs], ":", color="tab:gray", marker="s",
             markersize=4, label="output tok/s")
    tok.set_ylabel("output tokens/s", color="tab:gray")

    log_x = not single and min(xs) > 0 and max(xs) / min(xs) >= 8
    for a in (*axes, tok):  # headroom above the data for the value labels and legends
        a.set_ylim(0, max(a.get_ylim()[1], 1e-9) * 1.15)
    for a in axes:
        if log_x:
            a.set_xscale("log")
        a.set_xticks(xs, labels)
        a.minorticks_off()
        a.set_xlabel(xlabel)
        a.grid(True, alpha=0.3)
        if single:  # a visible range around the one point instead of a degenerate axis
            a.set_xlim(xs[0] * 0.5, xs[0] * 1.5)
    handles, names = axes[2].get_legend_handles_labels()
    h2, n2 = tok.get_legend_handles_labels()
    axes[2].legend(handles + h2, names + n2, loc="lower right", fontsize=8)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    done = sum(r["completed"] for r in runs)
    fig.suptitle(f"{title} - {len(runs)} load point(s), {done} requests completed".strip(" -"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
