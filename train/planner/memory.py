"""A compiled train step's memory: its device and host peaks (`footprint`, `host_footprint`, what
the planner measures; defined beside the trainer's memory line, `train.step.train_step`) and the
trainer's end-of-run report (`--memory-table`): the step's
per-device memory with each dispatcher, from XLA's buffer assignment of the compiled step
(`memory_analysis()`), compile-only for the dispatchers that did not train.

The step of another dispatcher is the same program with `ModelConfig.moe.options` changed,
compiled against the abstract state (`train_step.compile_abstract`: shapes and shardings, nothing
allocated), so nothing runs.
"""

from relaymoe_jax.op.options import MoEOptions

from ..step.train_step import footprint as footprint
from ..step.train_step import host_footprint as host_footprint


def options_label(options: MoEOptions) -> str:
    """How a table row names the dispatcher that `options` runs: "ring", "reference",
    "alltoall (dropless)" or "alltoall (capacity 0.5)", then ", FP8 experts" with expert_fp8."""
    fp8 = ", FP8 experts" if options.expert_fp8 else ""
    if options.dispatcher != "alltoall":
        return options.dispatcher + fp8
    cf = options.capacity_factor
    return ("alltoall (dropless)" if cf is None else f"alltoall (capacity {float(cf)!r})") + fp8


# the table's rows: (label, ModelConfig overrides), in order, in 16 bits; the trained run's own
# row is added after them when it is none of them (another capacity factor, the reference, a run
# with expert_fp8: "ring, FP8 experts")
MEMORY_TABLE_ROWS = tuple(
    (options_label(MoEOptions(**over)), over)
    for over in (
        {"dispatcher": "ring", "expert_fp8": False},
        {"dispatcher": "alltoall", "capacity_factor": None, "expert_fp8": False},
        {"dispatcher": "alltoall", "capacity_factor": 1.0, "expert_fp8": False},
    )
)


def memory_rows(cfg, tc, mesh, trained=None, log=print, packed: bool = False):
    """[(label, memory_analysis, how)] for every entry of MEMORY_TABLE_ROWS, then `cfg`'s own
    when it is none of them; `trained` is the compiled step that ran (reused for the config's
    own options), the others are compiled against the abstract state
    (`train_step.compile_abstract`, with segment ids if `packed`)."""
    from ..step import train_step  # the train extra's packages: `train.cli` imports this module

    own = cfg.moe.options.applicable()
    configs = [(label, cfg.replace(**over)) for label, over in MEMORY_TABLE_ROWS]
    if not any(c.moe.options.applicable() == own for _, c in configs):
        configs.append((options_label(own), cfg))
    rows = []
    for label, c in configs:
        if c.moe.options.applicable() == own and trained is not None:
            rows.append((label, trained.memory_analysis(), "trained"))
            continue
        log(f"compiling the train step with {label} (compile only) ...")
        compiled = train_step.compile_abstract(c, tc, mesh, packed=packed)
        rows.append((label, compiled.memory_analysis(), "compile-only"))
    return rows


def memory_table(rows) -> str:
    """Markdown table of `memory_rows`, with each row's footprint relative to the first's."""
    mib = lambda b: f"{b / 2**20:,.2f}"
    base = footprint(rows[0][1])
    out = [
        "| dispatcher | step | arguments MiB | temporaries MiB | total MiB | vs ring |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, m, how in rows:
        out.append(
            f"| {label} | {how} | {mib(m.argument_size_in_bytes)} | "
            f"{mib(m.temp_size_in_bytes)} | {mib(footprint(m))} | "
            f"{footprint(m) / base:.2f}x |"
        )
    return "\n".join(out)
