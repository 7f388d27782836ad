"""One MoE layer beyond one node: memory and link traffic per GPU at EP = 8 to 64, no GPU needed.

Each EP is a mesh of EP/8 hosts x 8 abstract H100s (or H200s; `relaymoe_jax.gpu_mesh`), axes
("node", "local"), the experts and tokens split over both (`expert_axis=("node", "local")`), and
each variant's forward and forward+backward of `moe_ffn` compiled (never run) by the XLA:GPU
compiler, bf16, the grouped matmul `--gmm` names (default auto: our Mosaic GPU kernel on H100/H200;
`--gmm pallas` the Triton one). Per row, all per GPU:

- fwd / fwd+bwd MiB: `compiled.memory_analysis().temp_size_in_bytes` (XLA's buffer assignment);
- x ring: fwd+bwd over that of the flat ring in the mode `routing="auto"` picks;
- hop KiB: the bytes of one flat ring hop (`memory.read_compiled`: the forward loop body's
  collective permutes, and the fwd+bwd program's loop bodies minus the forward's); for the
  hierarchical ring that reading sums its inner and outer loop bodies, so it is left to --json;
- cross-host / intra-host MiB: what the GPU that sends most sends in one fwd+bwd to GPUs of other
  hosts / of its own host, read from the fwd+bwd program's collective permutes and all-to-alls with
  loop trip counts (`relaymoe_jax.analysis.hlo.link_bytes`, `all_to_all_link_bytes`). Other
  collectives (the loss's all-reduce) are not counted;
- hidden hops: of the fwd+bwd program's cross-host collective permutes that have compute they
  could run beside (`relaymoe_jax.analysis.overlap.cross_host_transfers`, `free` > 0), the fewest
  ring hops of compute one of them is scheduled across (its start before them, its done after); "-"
  when no collective permute crosses hosts (the all-to-all's exchanges are not read here);
- compile s: trace + lower + compile of the fwd+bwd, seconds on this machine.

--json OUT writes, per row, the shape, the variant's `moe_ffn` arguments, both programs' temp /
argument / output / alias bytes, the hop bytes, both programs' per-GPU (partition id order)
same-host and cross-host bytes by collective permute and by all-to-all, and the compile seconds.

Variants: ring-expert and ring-token (the flat ring over all EP GPUs), hier-expert and hier-token
(`ring="hierarchical"`), a2a-cap1.0 and a2a-dropless (all-to-all). No time: nothing runs. The first
output line is the command that reproduces the table; --json writes every figure.
"""

import argparse
import inspect
import json
import os
import shlex
import sys
import time

from relaymoe_jax.cli.argtypes import positive_int

# name -> (relaymoe_jax.analysis.memory.VARIANTS entry, extra moe_ffn arguments)
VARIANTS = {
    "ring-expert": ("ring-expert", {"ring": "flat"}),
    "ring-token": ("ring-token", {"ring": "flat"}),
    "hier-expert": ("ring-expert", {"ring": "hierarchical"}),
    "hier-token": ("ring-token", {"ring": "hierarchical"}),
    "a2a-cap1.0": ("a2a-cap1.0", {}),
    "a2a-dropless": ("a2a-dropless", {}),
}
AXES = ("node", "local")
GPUS_PER_HOST = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ep",
        type=positive_int,
        nargs="+",
        default=[8, 16, 32, 64],
        help="expert-parallel sizes: up to 8 GPUs on one host, else multiples of 8 "
        "(default 8 16 32 64)",
    )
    p.add_argument(
        "--top-k", "-k", type=positive_int, nargs="+", default=[8, 16], help="default 8 16"
    )
    p.add_argument("--experts", "-E", type=positive_int, default=128, help="default 128")
    p.add_argument("--hidden", "-H", type=positive_int, default=2048, help="default 2048")
    p.add_argument("--ffn", "-F", type=positive_int, default=768, help="default 768")
    p.add_argument(
        "--tokens-per-device", "-T", type=positive_int, default=61440, help="default 61440"
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--target", choices=["h100", "h200"], default="h100")
    p.add_argument(
        "--gmm",
        choices=["auto", "mosaic", "pallas", "xla"],
        default="auto",
        help="grouped matmul: auto (default: our Mosaic GPU kernel on H100/H200), mosaic, "
        "pallas (the Triton kernel), xla (the blocked XLA one)",
    )
    p.add_argument("--json", metavar="OUT", help="write every measured figure to OUT (JSON)")
    a = p.parse_args(argv)
    for ep in a.ep:
        if ep > GPUS_PER_HOST and ep % GPUS_PER_HOST:
            p.error(
                f"--ep {ep}: more than {GPUS_PER_HOST} GPUs must fill whole hosts of "
                f"{GPUS_PER_HOST} (a multiple of {GPUS_PER_HOST})"
            )
        if a.experts % ep:
            p.error(f"--experts {a.experts} does not split over --ep {ep} GPUs")
    for k in a.top_k:
        if k > a.experts:
            p.error(f"--top-k {k} is more than --experts {a.experts}")
    return a


def has_ring_option():
    """Whether `moe_ffn` takes `ring=` (flat or hierarchical)."""
    from relaymoe_jax import moe_ffn

    return "ring" in inspect.signature(moe_ffn).parameters


def variant_kwargs(variant, gmm):
    """(memory.VARIANTS name, extra moe_ffn arguments); ring= only where moe_ffn takes it."""
    base, extra = VARIANTS[variant]
    extra = dict(extra, gmm_impl=gmm)
    if not has_ring_option():
        extra.pop("ring", None)
    return base, extra


def compile_variant(shape, mesh, variant, gmm):
    """The compiled forward and forward+backward of one variant, and their compile seconds."""
    import jax

    from relaymoe_jax import XLA_OPTIONS
    from relaymoe_jax.analysis import memory

    base, extra = variant_kwargs(variant, gmm)
    fns = memory.layer_fns(shape, mesh, base, AXES, extra)
    args = memory.abstract_args(shape, mesh, AXES)
    out, secs = [], []
    with jax.set_mesh(mesh):  # the options the trainer compiles with (train/step/train_step.py)
        for fn in fns:
            t0 = time.perf_counter()
            out.append(jax.jit(fn).trace(*args).lower().compile(compiler_options=XLA_OPTIONS))
            secs.append(time.perf_counter() - t0)
    return out, secs


def measure(shape, mesh, variant, gmm):
    """Every figure of one row (bytes per GPU; per-device lists indexed by partition id)."""
    from relaymoe_jax.analysis import hlo, memory, overlap

    (c_fwd, c_all), secs = compile_variant(shape, mesh, variant, gmm)
    hosts = hlo.host_of(mesh)
    row = dict(memory.read_compiled(c_fwd, c_all), compile_s_fwd=secs[0], compile_s_fwdbwd=secs[1])
    for prog, c in (("fwd", c_fwd), ("fwdbwd", c_all)):
        mem = c.memory_analysis()
        for field in ("temp", "argument", "output", "alias"):
            row[f"{prog}_{field}_bytes"] = getattr(mem, f"{field}_size_in_bytes")
        text = c.as_text()
        for kind, links in (
            ("permute", hlo.link_bytes(text, hosts)),
            ("a2a", hlo.all_to_all_link_bytes(text, hosts)),
        ):
            row[f"{prog}_{kind}_intra"], row[f"{prog}_{kind}_inter"] = links.intra, links.inter
    row["cross_host_transfers"] = [
        dict(hops=t.hops, free=t.free, bytes=t.bytes, op_name=t.op_name)
        for t in overlap.cross_host_transfers(c_all.as_text(), hosts)
    ]
    row["intra"] = [a + b for a, b in zip(row["fwdbwd_permute_intra"], row["fwdbwd_a2a_intra"])]
    row["inter"] = [a + b for a, b in zip(row["fwdbwd_permute_inter"], row["fwdbwd_a2a_inter"])]
    return row


def hidden_hops(row):
    """The table's "hidden hops" cell: the fewest hops any cross-host permute with compute
    beside it is scheduled across ("-": no permute crosses hosts, or none has compute beside
    it; all-to-alls are not read)."""
    hops = [t["hops"] for t in row["cross_host_transfers"] if t["free"]]
    return str(min(hops)) if hops else "-"


def main(argv=None):
    args = parse_args(argv)
    import logging
    import warnings

    import jax

    if "JAX_PLATFORMS" not in os.environ:  # jax is imported already: set its option
        jax.config.update("jax_platforms", "cpu")

    from relaymoe_jax.analysis import gpu_mesh, memory
    from relaymoe_jax.kernels.gmm import describe_impl

    logging.getLogger("relaymoe_jax").setLevel(logging.ERROR)  # capacity warnings: we know
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    cmd = " ".join(shlex.quote(a) for a in ["python", sys.argv[0], *(argv or sys.argv[1:])])
    print(f"# reproduce: {cmd}", flush=True)
    hier = [v for v in args.variants if VARIANTS[v][1].get("ring") == "hierarchical"]
    if hier and not has_ring_option():
        print(f"# skipped {', '.join(hier)}: this moe_ffn has no ring= option", flush=True)
        args.variants = [v for v in args.variants if v not in hier]
    device_bytes = gpu_mesh.device_memory(args.target)
    print(
        f"# jax {jax.__version__}, XLA:GPU compiler for EP/8 hosts x 8 abstract "
        f"{gpu_mesh.device_kind(args.target)} ({device_bytes / 2**30:,.1f} GiB each), no GPU: "
        f"buffer assignment only, no timing; E={args.experts} H={args.hidden} F={args.ffn} "
        f"T/dev={args.tokens_per_device} bfloat16, gmm_impl="
        f"{describe_impl(args.gmm, gpu_mesh.mesh((8,), ('expert',), target=args.target))}"
        "; MiB = 2^20 bytes"
    )
    print(
        "# per GPU: temp_size_in_bytes of the forward and the forward+backward; hop KiB: one "
        "flat ring hop's collective permutes (the hierarchical ring's are in --json: the sum "
        "over its loop bodies); cross-host / intra-host MiB: the most any GPU sends "
        "in one fwd+bwd by collective permute + all-to-all to other hosts / its own host; "
        "hidden hops: the fewest ring hops any cross-host transfer with compute beside it is "
        "scheduled across; 'x ring': fwd+bwd over the flat ring in the mode routing='auto' "
        "picks; compiled with relaymoe_jax.XLA_OPTIONS",
        flush=True,
    )
    head = (
        "EP",
        "hosts",
        "k",
        "variant",
        "fwd MiB",
        "fwd+bwd MiB",
        "x ring",
        "hop fwd KiB",
        "hop bwd KiB",
        "cross-host MiB",
        "intra-host MiB",
        "hidden hops",
        f"fwd+bwd % of {args.target.upper()}",
        "compile s (fwd+bwd)",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    record = {
        "command": cmd,
        "jax": jax.__version__,
        "target": args.target,
        "device_kind": gpu_mesh.device_kind(args.target),
        "device_bytes": device_bytes,
        "gmm_impl": args.gmm,
        "dtype": "bfloat16",
        "axes": list(AXES),
        "rows": [],
    }
    notes = []
    mib = lambda b: f"{memory.mib(b):,.1f}"
    for ep in args.ep:
        hosts, local = max(1, ep // GPUS_PER_HOST), min(ep, GPUS_PER_HOST)
        mesh = gpu_mesh.mesh((hosts, local), AXES, target=args.target)
        for k in args.top_k:
            s = memory.LayerShape(
                args.experts, k, args.hidden, args.ffn, args.tokens_per_device, ep, "bfloat16"
            )
            base = f"ring-{memory.table2(s).choice}"
            got = {}
            for v in args.variants:
                print(
                    f"# compiling EP={ep} ({hosts}x{local}) k={k} {v} ...",
                    file=sys.stderr,
                    flush=True,
                )
                t0 = time.perf_counter()
                try:
                    m = got[v] = measure(s, mesh, v, args.gmm)
                except (ValueError, NotImplementedError) as e:  # a variant the op refuses here
                    print(f"| {ep} | {hosts} | {k} | {v} | (failed: {e}) |", flush=True)
                    record["rows"].append(
                        dict(ep=ep, hosts=hosts, top_k=k, variant=v, error=str(e))
                    )
                    continue
                print(f"#   done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                ring = v.startswith("ring")  # the flat ring: one loop body is one hop
                cells = [
                    ep,
                    hosts,
                    k,
                    v,
                    mib(m["fwd"]),
                    mib(m["fwdbwd"]),
                    f"{m['fwdbwd'] / got[base]['fwdbwd']:.2f}" if base in got else "-",
                    f"{m['hop_fwd'] / 2**10:,.1f}" if ring else "",
                    f"{m['hop_bwd'] / 2**10:,.1f}" if ring else "",
                    mib(max(m["inter"])),
                    mib(max(m["intra"])),
                    hidden_hops(m),
                    f"{100 * m['fwdbwd'] / device_bytes:,.1f}",
                    f"{m['compile_s_fwdbwd']:,.0f}",
                ]
                print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
                record["rows"].append(
                    dict(
                        ep=ep,
                        hosts=hosts,
                        gpus_per_host=local,
                        experts=s.experts,
                        top_k=k,
                        hidden=s.hidden,
                        ffn=s.ffn,
                        tokens_per_device=s.tokens_per_device,
                        variant=v,
                        moe_ffn_kwargs=dict(
                            memory.VARIANTS[VARIANTS[v][0]], **variant_kwargs(v, args.gmm)[1]
                        ),
                        **m,
                    )
                )
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(record, f, indent=1)
            if base in got:
                ratios = ", ".join(
                    f"{v} / {base} {got[v]['fwdbwd'] / got[base]['fwdbwd']:.2f}x"
                    for v in ("a2a-cap1.0", "a2a-dropless", "hier-expert", "hier-token")
                    if v in got
                )
                across = ", ".join(f"{v} {mib(max(m['inter']))}" for v, m in got.items())
                notes.append(
                    f"- EP {ep} ({hosts} x {local}) k={k}: {base} "
                    f"{mib(got[base]['fwdbwd'])} MiB fwd+bwd"
                    + (ratios and f"; {ratios}")
                    + f"; cross-host MiB per GPU: {across}"
                )
    print("\n" + "\n".join(notes), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the plugin missing, a shape the op refuses: one line
        from relaymoe_jax.analysis import gpu_mesh

        if isinstance(e, (gpu_mesh.PluginMissing, ValueError)):
            sys.exit(f"scaling.py: error: {e}")
        raise
