"""What `python -m train.planner` prints: the header (where the sizes come from, how each
dispatcher spreads the experts), the remat-plan table per dispatcher, the largest-size tables,
and the "nothing fits" line. Text only; the compiles are `train.planner`'s."""

import dataclasses
import math

from relaymoe_jax.models.sharding import rules_for
from relaymoe_jax.op import topology


@dataclasses.dataclass(frozen=True)
class LargestSize:
    """The largest batch or sequence one dispatcher's fully recomputed step fits at."""

    dispatcher: str
    size: int | None  # None: not even the smallest fits
    search: object  # train.search.Search: the probes
    report: object  # planner.RematReport of the plan at `size`, None if nothing fits


@dataclasses.dataclass
class Findings:
    """What the planner found, per dispatcher, in the order it ran them."""

    reports: list = dataclasses.field(default_factory=list)  # planner.RematReport
    by_batch: list[LargestSize] = dataclasses.field(default_factory=list)
    by_seq: list[LargestSize] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    rings: list[str] = dataclasses.field(default_factory=list)  # `expert_parallelism` lines

    def note_once(self, marker: str, text: str) -> None:
        if not any(marker in n for n in self.notes):
            self.notes.append(text)

    def anything_fits(self) -> bool:
        return any(r.fits for r in self.reports) or any(
            f.size is not None for f in self.by_batch + self.by_seq
        )


def _axes(names) -> str:
    return f"{names[0]!r}" if len(names) == 1 else f"{names}"


def expert_parallelism(cfg, mesh) -> str:
    """How `cfg.moe.options.dispatcher` moves the experts' work over `mesh`: which ring (flat or
    hierarchical, and why with ring="auto"; `relaymoe_jax.op.topology`) over which axes."""
    opts = cfg.moe.options
    axes = rules_for(mesh).axes("experts")
    size = lambda names: math.prod(mesh.shape[a] for a in names)
    over = _axes(axes)
    if opts.dispatcher == "alltoall":
        return f"alltoall: all-to-all over {over} ({size(axes)} devices)"
    if opts.dispatcher != "ring":
        return f"{opts.dispatcher}: experts over {over} ({size(axes)} devices), no ring"
    inner, outer = axes[-1], axes[:-1]
    found = topology.spans(mesh, axes)  # (inner within a host, outer across hosts)
    if topology.choose_ring(opts.ring, mesh, axes):
        where = (
            ("", "")
            if found is None
            else (
                ", within a host" if found[0] else ", crossing hosts",
                ", across hosts" if found[1] else ", within a host",
            )
        )
        return (
            f"ring: hierarchical (ring={opts.ring}): inner ring over {inner!r} "
            f"({mesh.shape[inner]} devices{where[0]}), outer over {_axes(outer)} "
            f"({size(outer)}{where[1]})"
        )
    why = _why_flat(mesh, axes, found) if opts.ring == "auto" else ""
    return f"ring: flat (ring={opts.ring}{why}) over {over} ({size(axes)} devices)"


def _why_flat(mesh, axes, found) -> str:
    """Why `ring="auto"` runs the flat ring over `axes` (": reason"), or ""."""
    inner, outer = axes[-1], axes[:-1]
    if len(axes) < 2:
        return ": one expert axis"
    if mesh.shape[inner] < 2 or math.prod(mesh.shape[a] for a in outer) < 2:
        return ": an expert axis of size 1"
    if found is not None and not found[0]:
        return f": {inner!r} crosses hosts"
    if found is not None and not found[1]:
        return f": {_axes(outer)} stays on one host"
    return ""


def _plan_text(plan) -> str:
    return ", ".join(f"{n}x {o}" for o, n in plan.counts().items())


def replan_notes(report, where: str) -> list[str]:
    """A note per plan of `report` (planner.RematReport, at `where`: "batch B x seq S") whose
    compiled step did not fit and was planned again within less."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    return [
        f"{report.dispatcher} at {where}: the plan {_plan_text(plan)} compiled to {mib(peak)} "
        f"MiB, {mib(peak - report.capacity)} MiB over (XLA's buffer assignment is not the sum of "
        "the bytes the plan keeps); planned again within less"
        for plan, peak in report.misses
    ]


def table(reports: list) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"
    rows = [
        "| dispatcher | full-recompute peak MiB | of which train state | budget MiB | plan | "
        "planned peak MiB | fits | recompute GFLOP saved (cost_analysis) | (formula) |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in reports:
        measured = "n/a" if r.flops_saved is None else f"{r.flops_saved / 1e9:,.3f}"
        state = "" if r.full.state is None else mib(r.full.state)
        rows.append(
            f"| {r.dispatcher} | {mib(r.full.peak)} | {state} | {mib(r.plan.budget)} | "
            f"{_plan_text(r.plan)} | "
            f"{mib(r.planned.peak)} | {'yes' if r.fits else 'NO'} | "
            f"{measured} | {r.plan.flops_saved / 1e9:,.3f} |"
        )
    return "\n".join(rows)


def size_table(title: str, field: str, found: list[LargestSize]) -> str:
    rows = [
        title,
        f"| dispatcher | largest {field} | full-recompute peak MiB | probes | "
        "remat plan at that size |",
        "|---|---:|---:|---:|---|",
    ]
    for f in found:
        d, size, rec, rep = f.dispatcher, f.size, f.search, f.report
        if size is None:
            rows.append(
                f"| {d} | none fits | {rec.probes[0][1] / 2**20:,.1f} | {len(rec.probes)} | |"
            )
            continue
        peak = dict(rec.probes)[size]
        rows.append(
            f"| {d} | {size:,} | {peak / 2**20:,.1f} | {len(rec.probes)} | {_plan_text(rep.plan)} |"
        )
    return "\n".join(rows)


def summary(head: str, tc, found: Findings) -> str:
    """Everything after the per-dispatcher progress lines: the header, the plan table and its
    notes, then the largest-size tables."""
    text = (
        f"\n{head}\nexpert parallelism: "
        + "; ".join(found.rings)
        + f"\nbatch {tc.batch_size} x seq {tc.seq_len}:\n"
        + table(found.reports)
        + "".join(f"\n- {n}" for n in found.notes)
    )
    if found.by_batch:
        title = f"largest micro-batch at seq {tc.seq_len}:"
        text += "\n\n" + size_table(title, "batch", found.by_batch)
    if found.by_seq:
        title = f"largest sequence at micro-batch {tc.batch_size}:"
        text += "\n\n" + size_table(title, "seq", found.by_seq)
    return text
