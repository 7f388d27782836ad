"""The end-of-run report: the train step's per-device memory with each dispatcher, from XLA's
buffer assignment of the compiled step (`memory_analysis()`), compile-only for the dispatchers
that did not train.

The step of another dispatcher is the same program with `ModelConfig.moe.options` changed,
compiled against the abstract state (`train_step.compile_abstract`: shapes and shardings, nothing
allocated), so nothing runs.
"""

from . import train_step

# the table's rows: (label, ModelConfig overrides), in order
MEMORY_TABLE_ROWS = (
    ("ring", {"dispatcher": "ring"}),
    ("alltoall (dropless)", {"dispatcher": "alltoall", "capacity_factor": None}),
    ("alltoall (capacity 1.0)", {"dispatcher": "alltoall", "capacity_factor": 1.0}),
)


def memory_rows(cfg, tc, mesh, trained=None, log=print, packed: bool = False):
    """[(label, memory_analysis, how)] for every entry of MEMORY_TABLE_ROWS; `trained` is the
    compiled step that ran (reused for the config's own dispatcher), the others are compiled
    against the abstract state (`train_step.compile_abstract`, with segment ids if `packed`)."""
    rows = []
    for label, over in MEMORY_TABLE_ROWS:
        c = cfg.replace(**over)
        same = c.moe.options == cfg.moe.options
        if same and trained is not None:
            rows.append((label, trained.memory_analysis(), "trained"))
            continue
        log(f"compiling the train step with {label} (compile only) ...")
        rows.append(
            (
                label,
                train_step.compile_abstract(c, tc, mesh, packed=packed).memory_analysis(),
                "compile-only",
            )
        )
    return rows


def footprint(m) -> int:
    """Bytes live at once per device: arguments + temporaries + outputs not aliased to a donated
    argument."""
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


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
