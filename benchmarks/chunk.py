"""The ring's chunk: one layer's fwd+bwd memory per chunk size at the paper's shape, and its cost.

    python benchmarks/chunk.py                 # memory table (XLA:GPU, 8 abstract H100s)
    python benchmarks/chunk.py --cpu-time      # also: CPU time, old default vs new, one run
    python benchmarks/chunk.py --gmm-impl pallas -k 8 --chunks default   # one row, the Triton
                                               # kernel (the ring's; the all-to-all keeps "auto")

Memory: the paper's shape (E=128, H=2048, F=768, 61,440 tokens per device, EP=8, bf16, k=8 and
16), compiled (never run) by the XLA:GPU compiler for 8 abstract H100s with `XLA_OPTIONS` and
`--gmm-impl` (default "auto": our Mosaic GPU kernel there; `relaymoe_jax.gpu_mesh`, the
gpu-compile extra): the fwd+bwd temp bytes per device
(`compiled.memory_analysis()`) of the ring (expert routing) at each chunk, against the capacity-1.0
all-to-all's. Per row: pairs per hop (the balanced share T*k/EP), chunks per hop, the experts one
chunk spans (a chunk is a contiguous run of the hop's expert-sorted pairs: about chunk / (T*k/E) + 1
of them, at most E/EP) and its grouped-matmul rows per expert (chunk / that: what fills the
kernel's row tiles).
"default" is `relaymoe_jax.dispatch.chunking.default_chunk`; "balanced share" the old default.

--cpu-time: ring fwd+bwd on 8 emulated CPU devices (blocked XLA grouped matmul, float32) at a
CPU-sized shape whose hop holds more than one default chunk (E=128, k=8, H=256, F=96, 16,384
tokens per device: 16,384 pairs per hop, 2 chunks), the old default (1 chunk) against the new, in
one run: median of --runs after a warm-up. A CPU is no GPU: this shows the per-chunk overhead of
the schedule itself (loop trips, gathers, the f32 dW accumulation), not kernel launch latency.
"""

import argparse
import math
import os
import shlex
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from relaymoe_jax.cli.argtypes import positive_int

PAPER = dict(experts=128, hidden=2048, ffn=768, tokens_per_device=61440, ep=8)
CHUNKS = ("default", "balanced share", 32768, 16384, 8192, 4096)
CPU_SHAPE = dict(experts=128, top_k=8, hidden=256, ffn=96, tokens_per_device=16384, ep=8)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=["h100", "h200"], default="h100")
    p.add_argument("--top-k", "-k", type=positive_int, nargs="+", default=[8, 16])
    p.add_argument("--cpu-time", action="store_true", help="also time old vs new default on CPU")
    p.add_argument("--no-memory", action="store_true", help="skip the GPU-compiler table")
    p.add_argument("--runs", type=positive_int, default=5, help="timed runs (default 5)")
    p.add_argument(
        "--gmm-impl",
        choices=["auto", "mosaic", "pallas"],
        default="auto",
        help="the ring's grouped matmul in the memory table (default auto: our Mosaic GPU "
        "kernel on H100/H200; the all-to-all's is always auto)",
    )
    p.add_argument(
        "--chunks",
        nargs="+",
        choices=[str(c) for c in CHUNKS],
        default=[str(c) for c in CHUNKS],
        help="the memory table's rows (default all)",
    )
    return p.parse_args(argv)


def chunk_of(label, s) -> int:
    """The chunk a CHUNKS entry means for shape `s`."""
    from relaymoe_jax.dispatch import chunking

    if label == "default":
        return chunking.default_chunk(s.tokens_per_device, s.top_k, s.ep, s.experts)
    if label == "balanced share":
        return chunking.balanced_share(s.tokens_per_device, s.top_k, s.ep)
    return int(label)


def fwdbwd_temp(s, mesh, variant, extra=None) -> int:
    """fwd+bwd temp bytes per device of `variant` at shape `s`, compiled for `mesh` (`extra`:
    more moe_ffn keyword arguments)."""
    import jax

    from relaymoe_jax import XLA_OPTIONS
    from relaymoe_jax.analysis import memory

    fwdbwd = memory.layer_fns(s, mesh, variant, extra=extra)[1]
    with jax.set_mesh(mesh):
        c = (
            jax.jit(fwdbwd)
            .trace(*memory.abstract_args(s, mesh))
            .lower()
            .compile(compiler_options=XLA_OPTIONS)
        )
    return c.memory_analysis().temp_size_in_bytes


def memory_table(args):
    import dataclasses

    from relaymoe_jax.analysis import gpu_mesh, memory
    from relaymoe_jax.dispatch import chunking
    from relaymoe_jax.kernels.gmm import describe_impl

    mesh = gpu_mesh.mesh((PAPER["ep"],), ("expert",), target=args.target)
    print(
        f"# XLA:GPU for {PAPER['ep']} abstract {gpu_mesh.device_kind(args.target)}, "
        f"XLA_OPTIONS, ring gmm_impl={describe_impl(args.gmm_impl, mesh)}, bf16, "
        "fwd+bwd temp_size_in_bytes per device, "
        "MiB = 2^20 bytes; paper shape E128 H2048 F768 T61440/dev EP8",
        flush=True,
    )
    print(
        "| k | chunk | pairs | pairs per hop | chunks per hop | experts per chunk | rows per "
        "expert | ring MiB | capacity 1.0 MiB | capacity 1.0 / ring |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    e_local = PAPER["experts"] // PAPER["ep"]
    for k in args.top_k:
        base = memory.LayerShape(top_k=k, dtype="bfloat16", **PAPER)
        cap = fwdbwd_temp(base, mesh, "a2a-cap1.0")
        per_hop = chunking.balanced_share(base.tokens_per_device, k, base.ep)
        for label in (c for c in CHUNKS if str(c) in args.chunks):
            c = chunk_of(label, base)
            spans = min(e_local, math.ceil(c / (per_hop / e_local)) + 1)
            ring = fwdbwd_temp(
                dataclasses.replace(base, chunk=c), mesh, "ring-expert", {"gmm_impl": args.gmm_impl}
            )
            print(
                f"| {k} | {label} | {c:,} | {per_hop:,} | {math.ceil(per_hop / c)} | {spans} | "
                f"{c / spans:,.0f} | {memory.mib(ring):,.1f} | {memory.mib(cap):,.1f} | "
                f"{cap / ring:.2f}x |",
                flush=True,
            )


def cpu_time(args):
    import dataclasses

    import jax
    import moe_layer

    from relaymoe_jax.analysis import memory

    s = memory.LayerShape(dtype="float32", **CPU_SHAPE)
    mesh = jax.make_mesh((s.ep,), ("expert",))
    print(
        f"# {jax.device_count()} emulated CPU devices, ring (expert routing) fwd+bwd, "
        f"gmm_impl xla, float32, E{s.experts} k{s.top_k} H{s.hidden} F{s.ffn} "
        f"T{s.tokens_per_device}/dev; median of {args.runs} runs after a warm-up",
        flush=True,
    )
    print("| chunk | pairs | chunks per hop | fwd+bwd ms | x balanced share |")
    print("|---|---:|---:|---:|---:|")
    per_hop = chunk_of("balanced share", s)
    times = {}
    for label in ("balanced share", "default"):
        c = chunk_of(label, s)
        times[label] = moe_layer.time_fwdbwd(
            dataclasses.replace(s, chunk=c), mesh, "ring-expert", args.runs
        )
        print(
            f"| {label} | {c:,} | {math.ceil(per_hop / c)} | {times[label] * 1e3:,.0f} | "
            f"{times[label] / times['balanced share']:.2f}x |",
            flush=True,
        )


def main(argv=None):
    args = parse_args(argv)
    from relaymoe_jax.cli.devices import use_cpu_devices

    use_cpu_devices(CPU_SHAPE["ep"])
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    cmd = " ".join(
        shlex.quote(a)
        for a in ["python", "benchmarks/chunk.py", *(sys.argv[1:] if argv is None else argv)]
    )
    print(f"# reproduce: {cmd}", flush=True)
    if not args.no_memory:
        memory_table(args)
    if args.cpu_time:
        cpu_time(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
