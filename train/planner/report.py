"""What `python -m train.planner` prints: the header (where the sizes come from, how each
dispatcher spreads the experts), the remat-plan table per dispatcher (device and host bytes per
device), the largest-size tables, and the "nothing fits" line. Text only; the compiles are
`plan`'s."""

import dataclasses
import math

from relaymoe_jax.models.sharding import rules_for
from relaymoe_jax.op import topology

from ..step.accumulate import describe


@dataclasses.dataclass(frozen=True)
class LargestSize:
    """The largest batch or sequence one dispatcher's fully recomputed step fits at."""

    dispatcher: str
    size: int | None  # None: not even the smallest fits
    search: object  # train.planner.search.Search: the probes
    report: object  # planner.RematReport of the plan at `size`, None if nothing fits


@dataclasses.dataclass(frozen=True)
class Misfit:
    """A dispatcher whose fully recomputed step does not fit at --batch x --seq: a table row."""

    dispatcher: str
    full: object  # planner.StepCost of the fully recomputed step
    over: str  # the memory it overflows: "device memory", "host memory" or both
    fits = False


@dataclasses.dataclass
class Findings:
    """What the planner found, per dispatcher, in the order it ran them."""

    reports: list = dataclasses.field(default_factory=list)  # planner.RematReport or Misfit
    by_batch: list[LargestSize] = dataclasses.field(default_factory=list)
    by_seq: list[LargestSize] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    rings: list[str] = dataclasses.field(default_factory=list)  # `expert_parallelism` lines
    rates: object = None  # predict.Rates on a GPU (a target or a local one), else None
    predictions: list = dataclasses.field(default_factory=list)  # (dispatcher, predict.Prediction)

    def note_once(self, marker: str, text: str) -> None:
        if not any(marker in n for n in self.notes):
            self.notes.append(text)

    def host_used(self) -> bool:
        """Whether any step measured used host memory (offloaded state or residuals)."""
        return any(r.full.host for r in self.reports) or any(
            any(f.search.hosts.values()) for f in self.by_batch + self.by_seq
        )

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


def _mib(b: int) -> str:
    return f"{b / 2**20:,.1f}"


def replan_notes(report, where: str) -> list[str]:
    """A note per plan of `report` (planner.RematReport, at `where`: "batch B x seq S") whose
    compiled step did not fit and was planned again: within less device memory, or with every
    layer `full` when its host bytes were over."""
    notes = []
    for plan, peak, host in report.misses:
        head = f"{report.dispatcher} at {where}: the plan {_plan_text(plan)} compiled to "
        if peak > report.capacity:
            notes.append(
                f"{head}{_mib(peak)} MiB, {_mib(peak - report.capacity)} MiB over (XLA's buffer "
                "assignment is not the sum of the bytes the plan keeps); planned again within less"
            )
        else:
            notes.append(
                f"{head}{_mib(host)} MiB of host memory, {_mib(host - report.host_capacity)} MiB "
                "over --host-memory; planned again with every layer full"
            )
    return notes


def _verdict(over: str) -> str:
    """The fits column: "yes", "NO" (device memory), "NO (host memory)" or both."""
    return "yes" if not over else "NO" if over == "device memory" else f"NO ({over})"


def table(reports: list) -> str:
    """The plan table: per dispatcher, the fully recomputed step's device bytes (and the train
    state's among them) and host bytes (and the offloaded train state's), the plan and whether
    it fits (device and host); a `Misfit` row has the full step's figures only."""
    rows = [
        "| dispatcher | full-recompute peak MiB | of which train state | host MiB | of which "
        "host state | budget MiB | plan | planned peak MiB | fits | recompute GFLOP saved "
        "(cost_analysis) | (formula) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in reports:
        f = r.full
        state, host_state = ("" if b is None else _mib(b) for b in (f.state, f.host_state))
        cells = [r.dispatcher, _mib(f.peak), state, _mib(f.host), host_state]
        if isinstance(r, Misfit):
            cells += ["", "", "", _verdict(r.over), "", ""]
        else:
            measured = "n/a" if r.flops_saved is None else f"{r.flops_saved / 1e9:,.3f}"
            cells += [_mib(r.plan.budget), _plan_text(r.plan), _mib(r.planned.peak)]
            cells += [_verdict(r.over), measured, f"{r.plan.flops_saved / 1e9:,.3f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


CPU_OFFLOAD_NOTE = (
    "offload on XLA:CPU: its buffer assignment reports no host bytes, so what the offloads move "
    "(the train state, the layer inputs) is counted in the device columns, the host columns "
    "show none of it, and --host-memory limits nothing; --target h100|h200 compiles for the "
    "GPU, which places them in host memory and counts them there"
)


def config_notes(cfg, tc, target: bool) -> list[tuple[str, str]]:
    """(marker, note) of what the config means for the table: chunked attention's FLOPs column,
    offload_layer_inputs' plan, and offload on XLA:CPU (no --target)."""
    notes = []
    if cfg.attention_impl == "chunked":
        notes.append(
            (
                "while loop",
                "chunked attention: XLA's cost_analysis counts a while loop's body "
                "once, so its column sees one pair of blocks of the attention; the formula "
                "column counts them all",
            )
        )
    if cfg.offload_layer_inputs:
        notes.append(
            (
                "offload_layer_inputs",
                "offload_layer_inputs: every layer stays `full` (the config requires it), so "
                "the plan is all `full` whatever the budget",
            )
        )
    if not target and (tc.offload_optimizer or cfg.offload_layer_inputs):
        notes.append(("offload on XLA:CPU", CPU_OFFLOAD_NOTE))
    return notes


def _figure(x: float) -> str:
    """4 significant digits, thousands separated: 711.9, 1,473, 246,514, 8.511e-05."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def prediction_table(found: Findings) -> str:
    """The predicted step time and MFU of each planned step that fits (`predict`), and the rates
    behind them."""
    rows = [
        "predicted step time (a prediction from FLOPs and the cost model's rates, not a "
        "measurement: train/planner/predict.py; compute only, one document per row):",
        "| dispatcher | tokens per optimizer step | model TFLOP per device | executed TFLOP "
        "per device (recompute, attention backward) | predicted s/step | of which attention "
        "| tokens/s | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, p in found.predictions:
        mfu = "n/a" if p.mfu is None else f"{p.mfu:.1%}"
        figures = (p.model_flops / 1e12, p.executed_flops / 1e12, p.seconds, p.attention_seconds)
        cells = [d, f"{p.tokens:,}", *map(_figure, figures), _figure(p.tokens_per_s), mfu]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows + [f"- {line}" for line in found.rates.report()])


def size_table(title: str, field: str, found: list[LargestSize]) -> str:
    """A largest-size table: the size, the fully recomputed step's device and host MiB there (or,
    when nothing fits, at the smallest size and which memory it overflows), the probes, the plan."""
    rows = [
        title,
        f"| dispatcher | largest {field} | full-recompute peak MiB | host MiB | probes | "
        "remat plan at that size |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for f in found:
        d, size, rec, rep = f.dispatcher, f.size, f.search, f.report
        at = rec.probes[0][0] if size is None else size
        peak, host = dict(rec.probes)[at], rec.hosts.get(at, 0)
        said = (
            f"{size:,}" if size is not None else _verdict(rec.over(at)).replace("NO", "none fits")
        )
        plan = "" if rep is None else _plan_text(rep.plan)
        rows.append(f"| {d} | {said} | {_mib(peak)} | {_mib(host)} | {len(rec.probes)} | {plan} |")
    return "\n".join(rows)


def host_pool_note(target: bool) -> str:
    """The note under the tables when a step uses host memory: XLA's own pinned-host pool."""
    return (
        "host memory: XLA's GPU client takes pinned host memory from one pool per process, 64 "
        "GiB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (GiB) says more (XLA's gpu_helpers.cc; "
        "not measured here): with one process for a node's 8 GPUs, set it to at least 8 x the "
        "host MiB above" + ("" if target else "; the host figures are XLA:CPU's")
    )


def summary(head: str, tc, found: Findings) -> str:
    """Everything after the per-dispatcher progress lines: the header, the plan table and its
    notes, then the largest-size tables."""
    text = (
        f"\n{head}\nexpert parallelism: "
        + "; ".join(found.rings)
        + f"\n{describe(tc)}:\n"
        + table(found.reports)
        + "".join(f"\n- {n}" for n in found.notes)
    )
    if found.predictions:
        text += "\n\n" + prediction_table(found)
    if found.by_batch:
        title = f"largest micro-batch at seq {tc.seq_len}:"
        text += "\n\n" + size_table(title, "batch", found.by_batch)
    if found.by_seq:
        title = f"largest sequence at micro-batch {tc.batch_size}:"
        text += "\n\n" + size_table(title, "seq", found.by_seq)
    return text
