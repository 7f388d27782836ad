"""The two uses of the ring's saved memory in full-model training (paper §4.4), scaled to compile
on CPU: longer sequences (Figure 15) and less attention recomputation (Figure 13).

    python benchmarks/capacity.py [--memory 1GiB] [--batch 8] [--max-seq 32768] [--seq-step 256]
        [--throughput 1280:24,2048:16,3072:8] [--out docs/img/capacity.png] [k=v ...]

Model: configs/qwen3-30b-a3b.yaml with the paper's routing (E=128 experts, top-8) and the
sizes of SCALED below (hidden 256, expert FFN 96, 4 layers, 4 query heads and 1 kv head of 64,
chunked attention in key blocks of 128), on 8 emulated CPU devices, EP=8, float32. `k=v`
arguments override model or train fields. Everything is compiled, never run: each figure is the
per-device peak of the whole train step (forward, backward, AdamW update) from XLA's buffer
assignment (`memory_analysis()`: arguments + temporaries + outputs not aliased), as in
`python -m train.planner`. `--memory` is the usable capacity of the scaled device.

Dispatchers: the ring (routing "auto"), the dropless all-to-all (static receive buffers sized for
the worst case) and the all-to-all with capacity factor 1.0 (buffers of T*k rows, the size a
balanced dynamic-shape dropless all-to-all such as Megatron's would allocate; it drops the pairs
that overflow). As in the paper, every attention block and every MoE block is recomputed in the
backward (`attention_remat=full`, `moe_remat=true`) for the capacity experiment.

1. Capacity (Figure 15): the largest sequence length, a multiple of --seq-step, whose step fits
   --memory at micro-batch --batch (doubling then bisection, one compile per probe).
2. Recomputation (Figure 13): at each --throughput SEQ:BATCH (the paper's 40K/65K/98K at
   micro-batches 12/8/5, scaled by 1/32 and rounded to multiples of EP, so tokens per step stay
   about constant), the greedy solver's attention plan within --memory minus the fully
   recomputed step's peak, compiled to check it fits. The FLOPs it saves are the solver's
   formula (`relaymoe_jax.remat.costs`): XLA's cost_analysis counts a while loop's body once, so
   it cannot see the chunked attention's key blocks.
"""

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from relaymoe_jax.models.configs import load_config, parse_overrides
from train import loop, planner  # train first: 8 emulated CPU devices before jax is imported
from train import mesh as train_mesh

CONFIG = "configs/qwen3-30b-a3b.yaml"
SCALED = dict(hidden_size=256, moe_intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=64, vocab_size=256,
              attention_impl="chunked", attention_block_k=128, max_position_embeddings=131072,
              attention_remat="full", moe_remat=True)
VARIANTS = {"ring": dict(dispatcher="ring"),
            "alltoall dropless": dict(dispatcher="alltoall"),
            "alltoall cap1.0": dict(dispatcher="alltoall", capacity_factor=1.0)}
MIB = 2**20


def configs(overrides: dict, mesh) -> dict:
    """{variant: ModelConfig} of the scaled model on `mesh` (default EP=8)."""
    ep = train_mesh.expert_size(dict(mesh.shape))
    return {name: load_config(CONFIG, expert_size=ep, **{**SCALED, **over, **overrides})
            for name, over in VARIANTS.items()}


def capacity(cfgs: dict, tc: loop.TrainConfig, mesh, memory: int, limit: int, step: int):
    """{variant: (largest seq or None, search record)} at micro-batch tc.batch_size."""
    found = {}
    for name, cfg in cfgs.items():
        print(f"# {name}: largest sequence at micro-batch {tc.batch_size} ...", flush=True)
        found[name] = planner.largest_size(cfg, tc, mesh, memory, field="seq_len", step=step,
                                           limit=limit, log=print)
    return found


def recompute(cfgs: dict, tc: loop.TrainConfig, mesh, memory: int, sizes):
    """{(seq, batch): {variant: RematReport or the reason it does not fit}}."""
    out = {}
    for seq, batch in sizes:
        t = dataclasses.replace(tc, seq_len=seq, batch_size=batch)
        out[seq, batch] = {}
        for name, cfg in cfgs.items():
            print(f"# {name}: remat plan at seq {seq}, micro-batch {batch} ...", flush=True)
            try:
                out[seq, batch][name] = planner.plan_remat(cfg, t, mesh, memory)
            except ValueError as e:
                out[seq, batch][name] = str(e)
    return out


def capacity_table(found: dict, memory: int) -> str:
    ring = found["ring"][0]
    rows = ["| dispatcher | largest seq | its peak MiB | next size probed | its peak MiB | "
            "ring / it |", "|---|---:|---:|---:|---:|---:|"]
    for name, (seq, rec) in found.items():
        peaks = dict(rec.probes)
        above = min((s for s in peaks if peaks[s] > memory), default=None)
        at_limit = " (the limit)" if seq == rec.limit else ""
        cells = [name, f"{seq:,}{at_limit}" if seq else "none fits",
                 f"{peaks[seq] / MIB:,.1f}" if seq else "",
                 f"{above:,}" if above else "", f"{peaks[above] / MIB:,.1f}" if above else "",
                 f"{'>= ' if ring == rec.limit else ''}{ring / seq:.2f}x" if seq and ring
                 else ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def recompute_table(plans: dict, cfgs: dict, mesh, dtype) -> str:
    rows = ["| seq | micro-batch | dispatcher | full-recompute peak MiB | plan | planned peak MiB "
            "| attention recompute GFLOP saved per device (formula) | of all avoidable |",
            "|---:|---:|---|---:|---|---:|---:|---:|"]
    for (seq, batch), by in plans.items():
        for name, r in by.items():
            if isinstance(r, str):
                rows.append(f"| {seq:,} | {batch} | {name} | does not fit | | | | |")
                continue
            costs = planner.remat.option_costs(planner.remat.AttentionShape.of(
                cfgs[name], batch, seq, dict(mesh.shape), dtype))
            best = len(r.plan.options) * max(c.flops for c in costs.values())
            plan = ", ".join(f"{n}x {o}" for o, n in r.plan.counts().items())
            rows.append(f"| {seq:,} | {batch} | {name} | {r.full.peak / MIB:,.1f} | {plan} | "
                        f"{r.planned.peak / MIB:,.1f} | {r.plan.flops_saved / 1e9:,.2f} | "
                        f"{r.plan.flops_saved / best:.0%} |")
    return "\n".join(rows)


def _plot_capacity(ax, found: dict, memory: int) -> None:
    for name, (seq, rec) in found.items():
        pts = sorted(rec.probes)
        line, = ax.plot([s for s, _ in pts], [p / MIB for _, p in pts], "o-", label=name)
        if seq:
            ax.annotate(f"{seq:,}", (seq, dict(rec.probes)[seq] / MIB), color=line.get_color(),
                        textcoords="offset points", xytext=(4, -12))
    ax.axhline(memory / MIB, color="k", ls="--", lw=1, label="capacity")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak MiB per device",
           title="capacity: full recomputation, same micro-batch")
    ax.legend()


def _plot_recompute(ax, plans: dict) -> None:
    names = list(VARIANTS)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(plans))]
        ys = [0 if isinstance(by[name], str) else by[name].plan.flops_saved / 1e9
              for by in plans.values()]
        bars = ax.bar(xs, ys, width, label=name)
        for x, by in zip(xs, plans.values()):
            if isinstance(by[name], str):
                ax.annotate("OOM", (x, 0), ha="center", va="bottom", fontsize=8,
                            color=bars.patches[0].get_facecolor())
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(plans))],
                  [f"seq {s:,}\nb={b}" for s, b in plans])
    ax.set(ylabel="attention recompute GFLOP saved / device / step",
           title="recomputation: greedy plan within the capacity")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory", default="1GiB", help="usable memory per device (default 1GiB)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch of the capacity search")
    p.add_argument("--max-seq", type=int, default=32768)
    p.add_argument("--seq-step", type=int, default=256)
    p.add_argument("--throughput", default="1280:24,2048:16,3072:8", metavar="SEQ:BATCH,...")
    p.add_argument("--parts", default="capacity,recompute",
                   help="capacity (Figure 15), recompute (Figure 13), or both (default)")
    p.add_argument("--out", type=Path, default=Path("docs/img/capacity.png"))
    p.add_argument("overrides", nargs="*", help="model or train key=value")
    args = p.parse_args(argv)
    print("# reproduce: python benchmarks/capacity.py " + shlex.join(
        [f"--memory={args.memory}", f"--batch={args.batch}", f"--max-seq={args.max_seq}",
         f"--seq-step={args.seq_step}", f"--throughput={args.throughput}",
         f"--parts={args.parts}", f"--out={args.out}",
         *args.overrides]), flush=True)
    parts = set(args.parts.split(","))
    if not parts or parts - {"capacity", "recompute"}:
        raise SystemExit(f"--parts {args.parts!r}: expected capacity, recompute or both")
    memory = planner.parse_memory(args.memory)
    sizes = [tuple(item.split(":")) for item in args.throughput.split(",") if item]
    if not all(len(s) == 2 and all(v.isdigit() and int(v) > 0 for v in s) for s in sizes):
        raise SystemExit(f"--throughput {args.throughput!r}: expected SEQ:BATCH[,SEQ:BATCH...] "
                         "with positive integers")
    sizes = [(int(a), int(b)) for a, b in sizes]
    over = parse_overrides(args.overrides)
    train_kw = {k: over.pop(k) for k in list(over) if k in loop.TRAIN_FIELDS}
    tc = loop.TrainConfig(batch_size=args.batch, seq_len=args.seq_step, **train_kw)
    mesh = train_mesh.make_mesh(tc.mesh)
    cfgs = configs(over, mesh)
    found = (capacity(cfgs, tc, mesh, memory, args.max_seq, args.seq_step)
             if "capacity" in parts else {})
    plans = recompute(cfgs, tc, mesh, memory, sizes) if "recompute" in parts and sizes else {}
    model = {**SCALED, **over}
    print(f"\nscaled {CONFIG} ({', '.join(f'{k}={v}' for k, v in model.items())}), "
          f"mesh {dict(mesh.shape)}, "
          f"{tc.compute_dtype}, capacity {memory / MIB:,.0f} MiB per device; XLA:CPU buffer "
          "assignment, compile only")
    if found:
        print(f"\nlargest sequence at micro-batch {args.batch} (Figure 15):\n"
              + capacity_table(found, memory))
    if plans:
        print("\nattention recomputation plans (Figure 13):\n"
              + recompute_table(plans, cfgs, mesh, tc.compute_dtype))
    print(f"plot: {plot(found, plans, memory, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
