"""What benchmarks/capacity.py prints and plots: the capacity table (Figure 15), the recomputation
plans' table (Figure 13) and their plot."""

from pathlib import Path

from relaymoe_jax import remat

MIB = 2**20


def capacity_table(found: dict, memory: int) -> str:
    ring = found["ring"][0]
    rows = [
        "| dispatcher | largest seq | its peak MiB | next size probed | its peak MiB | ring / it |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (seq, rec) in found.items():
        peaks = dict(rec.probes)
        above = min((s for s in peaks if peaks[s] > memory), default=None)
        at_limit = " (the limit)" if seq == rec.limit else ""
        cells = [
            name,
            f"{seq:,}{at_limit}" if seq else "none fits",
            f"{peaks[seq] / MIB:,.1f}" if seq else "",
            f"{above:,}" if above else "",
            f"{peaks[above] / MIB:,.1f}" if above else "",
            f"{'>= ' if ring == rec.limit else ''}{ring / seq:.2f}x" if seq and ring else "",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def recompute_table(plans: dict, cfgs: dict, mesh, dtype) -> str:
    rows = [
        "| seq | micro-batch | dispatcher | full-recompute peak MiB | plan | planned peak MiB "
        "| attention recompute GFLOP saved per device (formula) | of all avoidable |",
        "|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for (seq, batch), by in plans.items():
        for name, r in by.items():
            if isinstance(r, str):
                rows.append(f"| {seq:,} | {batch} | {name} | does not fit | | | | |")
                continue
            costs = remat.option_costs(
                remat.AttentionShape.of(cfgs[name], batch, seq, dict(mesh.shape), dtype)
            )
            best = len(r.plan.options) * max(c.flops for c in costs.values())
            plan = ", ".join(f"{n}x {o}" for o, n in r.plan.counts().items())
            rows.append(
                f"| {seq:,} | {batch} | {name} | {r.full.peak / MIB:,.1f} | {plan} | "
                f"{r.planned.peak / MIB:,.1f} | {r.plan.flops_saved / 1e9:,.2f} | "
                f"{r.plan.flops_saved / best:.0%} |"
            )
    return "\n".join(rows)


def _plot_capacity(ax, found: dict, memory: int) -> None:
    for name, (seq, rec) in found.items():
        pts = sorted(rec.probes)
        (line,) = ax.plot([s for s, _ in pts], [p / MIB for _, p in pts], "o-", label=name)
        if seq:
            ax.annotate(
                f"{seq:,}",
                (seq, dict(rec.probes)[seq] / MIB),
                color=line.get_color(),
                textcoords="offset points",
                xytext=(4, -12),
            )
    ax.axhline(memory / MIB, color="k", ls="--", lw=1, label="capacity")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="peak MiB per device",
        title="capacity: full recomputation, same micro-batch",
    )
    ax.legend()


def _plot_recompute(ax, plans: dict) -> None:
    names = list(next(iter(plans.values())))  # the dispatchers, in the order they ran
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(plans))]
        ys = [
            0 if isinstance(by[name], str) else by[name].plan.flops_saved / 1e9
            for by in plans.values()
        ]
        bars = ax.bar(xs, ys, width, label=name)
        for x, by in zip(xs, plans.values()):
            if isinstance(by[name], str):
                ax.annotate(
                    "OOM",
                    (x, 0),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=bars.patches[0].get_facecolor(),
                )
    ax.set_xticks(
        [j + width * (len(names) - 1) / 2 for j in range(len(plans))],
        [f"seq {s:,}\nb={b}" for s, b in plans],
    )
    ax.set(
        ylabel="attention recompute GFLOP saved / device / step",
        title="recomputation: greedy plan within the capacity",
    )
    ax.legend()


def plot(found: dict, plans: dict, memory: int, out: Path) -> Path:
    """One panel per part that ran: peak vs sequence length, and the FLOPs each plan saves."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in (found and "capacity", plans and "recompute") if p]
    fig = Figure(figsize=(5.5 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        if panel == "capacity":
            _plot_capacity(ax, found, memory)
        else:
            _plot_recompute(ax, plans)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
