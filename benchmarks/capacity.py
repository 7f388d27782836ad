"""The two uses of the ring's saved memory in full-model training (paper §4.4), scaled to compile
on CPU: longer sequences (Figure 15) and less attention recomputation (Figure 13); or, with
`--target`, the capacity experiment at full size on the XLA:GPU compiler.

    python benchmarks/capacity.py [--memory 1GiB] [--batch 8] [--max-seq 32768] [--seq-step 256]
        [--throughput 1280:24,2048:16,3072:8] [--out docs/img/capacity.png] [k=v ...]
    python benchmarks/capacity.py --target h100 --config configs/moe-k8.yaml --batch 12 \
        --seqs 40960,65536,92160,100352,116736,153600 mesh=context=8 [--max-seq L] [k=v ...]

With `--target h100|h200` the model is `--config` at its real size (none of SCALED below; only the
experiment's settings: chunked attention, every attention and MoE block recomputed), bf16, on
`--hosts` hosts of 8 abstract GPUs (`relaymoe_jax.gpu_mesh`, the `gpu-compile` extra, no GPU),
and `--memory` defaults to 0.9 x the target's. `--seqs` finds the longest of the listed sequence
lengths that fits (the paper's 40K-150K; `train.planner.search.largest_listed`: the smallest,
the largest, then where the measured peaks' line crosses the memory), `--max-seq` also searches
the largest that fits (doubling and bisection from `--seq-step`); every probe is one compile of
the whole train step by XLA:GPU.

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
backward (`attention_remat=full`, `moe_remat=true`: each decoder layer is one checkpoint that keeps
only its input) for the capacity experiment.

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
import os
import shlex
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's train/
    if "--target" in " ".join(sys.argv):  # before jax (gpu_mesh)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules, when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from capacity_report import MIB, capacity_table, plot, recompute_table

from relaymoe_jax.cli.devices import use_cpu_devices
from relaymoe_jax.models.config_files import load_config, parse_overrides
from train.planner import plan as planner
from train.settings import TRAIN_FIELDS, TrainConfig
from train.step import mesh as train_mesh

CONFIG = "configs/qwen3-30b-a3b.yaml"
# --target: the experiment's settings on a full-size config (paper §4.4: full recomputation)
# and the layer scan; key blocks of 128: each block's float32 scores are [b, S/8, heads, 128],
# 0.94 GiB per buffer at micro-batch 12 and 40,960 tokens (3.75 GiB with blocks of 512)
FULL_SIZE = dict(
    attention_impl="chunked",
    attention_block_k=128,
    attention_remat="full",
    moe_remat=True,
    scan_layers=True,
)
SCALED = dict(
    hidden_size=256,
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=256,
    attention_impl="chunked",
    attention_block_k=128,
    max_position_embeddings=131072,
    attention_remat="full",
    moe_remat=True,
)
VARIANTS = {
    "ring": dict(dispatcher="ring"),
    "alltoall dropless": dict(dispatcher="alltoall"),
    "alltoall cap1.0": dict(dispatcher="alltoall", capacity_factor=1.0),
}


def configs(overrides: dict, mesh, config: str = CONFIG, scaled: dict | None = None) -> dict:
    """{variant: ModelConfig} of `config` with `scaled` (default SCALED) on `mesh`."""
    ep = train_mesh.expert_size(dict(mesh.shape))
    scaled = SCALED if scaled is None else scaled
    return {
        name: load_config(config, expert_size=ep, **{**scaled, **over, **overrides})
        for name, over in VARIANTS.items()
    }


def probe(cfgs: dict, tc: TrainConfig, mesh, memory: int, seqs: list[int]) -> dict:
    """{variant: (longest of `seqs` that fits or None, search record of every probe)}: the fully
    recomputed step, one compile per probe, at as few of the listed lengths as
    `train.planner.search.largest_listed` needs (the smallest, the largest, then where the line
    through the measured peaks crosses `memory`)."""
    found = {}
    for name, cfg in cfgs.items():
        print(
            f"# {name}: the longest of {', '.join(f'{s:,}' for s in sorted(seqs))} at "
            f"micro-batch {tc.batch_size} ...",
            flush=True,
        )
        cfg = dataclasses.replace(
            cfg, max_position_embeddings=max(cfg.max_position_embeddings, *seqs)
        )
        peak = lambda seq, cfg=cfg: (
            planner.step_cost(cfg, dataclasses.replace(tc, seq_len=seq), mesh, memo=False).peak
        )
        found[name] = planner.search.largest_listed(
            peak, memory, seqs, log=lambda m: print(m, flush=True)
        )
    return found


def capacity(cfgs: dict, tc: TrainConfig, mesh, memory: int, limit: int, step: int):
    """{variant: (largest seq or None, search record)} at micro-batch tc.batch_size."""
    found = {}
    for name, cfg in cfgs.items():
        print(f"# {name}: largest sequence at micro-batch {tc.batch_size} ...", flush=True)
        found[name] = planner.largest_size(
            cfg, tc, mesh, memory, field="seq_len", step=step, limit=limit, log=print
        )
    return found


def recompute(cfgs: dict, tc: TrainConfig, mesh, memory: int, sizes):
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--memory",
        default=None,
        help="usable memory per device (default 1GiB; 0.9 x the device's with --target)",
    )
    p.add_argument(
        "--target",
        choices=list(planner.gpu_mesh.TARGETS),
        default=None,
        help="compile for abstract GPUs with XLA:GPU, --config at full size",
    )
    p.add_argument(
        "--hosts", type=planner.positive_int, default=1, help="with --target: hosts of 8 GPUs"
    )
    p.add_argument("--config", default=CONFIG, help=f"model config (default {CONFIG})")
    p.add_argument(
        "--seqs",
        default="",
        metavar="SEQ,...",
        help="probe these sequence lengths (each one compile per dispatcher)",
    )
    p.add_argument(
        "--batch", type=planner.positive_int, default=8, help="micro-batch of the capacity search"
    )
    p.add_argument(
        "--max-seq",
        type=planner.positive_int,
        default=None,
        help="search the largest sequence up to this (default 32768 without --seqs)",
    )
    p.add_argument("--seq-step", type=planner.positive_int, default=256)
    p.add_argument("--throughput", default="1280:24,2048:16,3072:8", metavar="SEQ:BATCH,...")
    p.add_argument(
        "--parts",
        default="capacity,recompute",
        help="capacity (Figure 15), recompute (Figure 13), or both (default)",
    )
    p.add_argument("--out", type=Path, default=Path("docs/img/capacity.png"))
    p.add_argument("overrides", nargs="*", help="model or train key=value")
    return p


def parse_seqs(args) -> list[int]:
    """--seqs as positive integers; --hosts checked; the defaults that depend on them set."""
    if args.hosts < 1 or (args.hosts != 1 and not args.target):
        raise SystemExit(f"--hosts {args.hosts}: expected >= 1, and only with --target")
    try:
        seqs = [int(v) for v in args.seqs.split(",") if v]
    except ValueError:
        seqs = [0]
    if any(v < 1 for v in seqs):
        raise SystemExit(f"--seqs {args.seqs!r}: expected positive integers SEQ[,SEQ...]")
    if args.target:
        args.parts = "capacity"
    if args.max_seq is None and not seqs:
        args.max_seq = 32768
    return seqs


def reproduce(args, seqs) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    target = args.target
    return "# reproduce: python benchmarks/capacity.py " + shlex.join(
        [
            *([f"--target={target}", f"--hosts={args.hosts}"] if target else []),
            *([f"--config={args.config}"] if args.config != CONFIG else []),
            *([f"--seqs={args.seqs}"] if seqs else []),
            *([f"--memory={args.memory}"] if args.memory else []),
            f"--batch={args.batch}",
            *([f"--max-seq={args.max_seq}", f"--seq-step={args.seq_step}"] if args.max_seq else []),
            *([f"--throughput={args.throughput}"] if not target else []),
            f"--parts={args.parts}",
            f"--out={args.out}",
            *args.overrides,
        ]
    )


def parse_parts(args) -> set:
    parts = set(args.parts.split(","))
    if not parts or parts - {"capacity", "recompute"}:
        raise SystemExit(f"--parts {args.parts!r}: expected capacity, recompute or both")
    return parts


def capacity_bytes(args) -> int:
    """--memory in bytes; its default 1GiB, or 0.9 x the device's with --target."""
    if args.memory:
        return planner.parse_memory(args.memory)
    if args.target:
        return int(0.9 * planner.gpu_mesh.device_memory(args.target))
    return planner.parse_memory("1GiB")


def parse_throughput(args) -> list[tuple[int, int]]:
    """--throughput as [(seq, batch)] of positive integers."""
    sizes = [tuple(item.split(":")) for item in args.throughput.split(",") if item]
    if not all(len(s) == 2 and all(v.isdigit() and int(v) > 0 for v in s) for s in sizes):
        raise SystemExit(
            f"--throughput {args.throughput!r}: expected SEQ:BATCH[,SEQ:BATCH...] "
            "with positive integers"
        )
    return [(int(a), int(b)) for a, b in sizes]


def setup(args):
    """(TrainConfig, mesh, where the figures come from, the model's sizes, {variant: config})."""
    target = args.target
    over = parse_overrides(args.overrides)
    offload = [k for k in ("offload_optimizer", "offload_layer_inputs") if over.get(k)]
    if offload:  # their bytes are in host memory, which this experiment does not check
        raise ValueError(
            f"{offload[0]}=true: this experiment measures device memory only, and the offload "
            "settings move state to host memory it would not check; use python -m train.planner "
            "--max-seq (it checks --host-memory too)"
        )
    train_kw = {k: over.pop(k) for k in list(over) if k in TRAIN_FIELDS}
    if target:
        train_kw.setdefault("compute_dtype", "bfloat16")
    tc = TrainConfig(batch_size=args.batch, seq_len=args.seq_step, **train_kw)
    if not target:
        mesh = train_mesh.make_mesh(tc.mesh)
        where = "XLA:CPU buffer assignment, compile only"
        return tc, mesh, where, {**SCALED, **over}, configs(over, mesh, args.config)
    gpu = planner.gpu_mesh
    shape = train_mesh.parse_mesh(tc.mesh, args.hosts * gpu.GPUS_PER_HOST)
    mesh = gpu.mesh(tuple(shape.values()), tuple(shape), target=target)
    where = (
        f"XLA:GPU buffer assignment for {mesh.devices.size} abstract "
        f"{gpu.device_kind(target)}, compile only, no GPU (no timing)"
    )
    return tc, mesh, where, {**FULL_SIZE, **over}, configs(over, mesh, args.config, FULL_SIZE)


def largest(args, cfgs, tc, mesh, memory, seqs) -> dict:
    """{variant: (largest seq or None, search record)}: the listed --seqs, then the --max-seq
    search, their probes merged into one record per dispatcher."""
    found = probe(cfgs, tc, mesh, memory, seqs) if seqs else {}
    if args.max_seq:
        searched = capacity(cfgs, tc, mesh, memory, args.max_seq, args.seq_step)
        for name, (seq, rec) in searched.items():
            if name in found:
                rec.probes = found[name][1].probes + rec.probes
            found[name] = (seq, rec)
    return found


def main(argv=None) -> int:
    use_cpu_devices(8)  # the emulated mesh, unless XLA_FLAGS sets a device count
    args = parser().parse_args(argv)
    seqs = parse_seqs(args)
    print(reproduce(args, seqs), flush=True)
    parts = parse_parts(args)
    memory = capacity_bytes(args)
    sizes = parse_throughput(args)
    tc, mesh, where, model, cfgs = setup(args)
    found = largest(args, cfgs, tc, mesh, memory, seqs) if "capacity" in parts else {}
    plans = recompute(cfgs, tc, mesh, memory, sizes) if "recompute" in parts and sizes else {}
    print(
        f"\n{'' if args.target else 'scaled '}{args.config} "
        f"({', '.join(f'{k}={v}' for k, v in model.items())}), mesh {dict(mesh.shape)}, "
        f"{tc.compute_dtype}, capacity {memory / MIB:,.0f} MiB per device; {where}"
    )
    if found:
        print(
            f"\nlargest sequence at micro-batch {args.batch} (Figure 15):\n"
            + capacity_table(found, memory)
        )
    if plans:
        print(
            "\nattention recomputation plans (Figure 13):\n"
            + recompute_table(plans, cfgs, mesh, tc.compute_dtype)
        )
    print(f"plot: {plot(found, plans, memory, args.out)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ValueError, FileNotFoundError, planner.gpu_mesh.PluginMissing) as e:
        sys.exit(f"capacity.py: error: {e}")
