"""Per-device memory (and optionally time) of one MoE layer: ring vs all-to-all.

Every figure is XLA's own buffer assignment (`compiled.memory_analysis()`), per device, on emulated
CPU devices. Run `python benchmarks/moe_layer.py --help`; the first output line is the command that
reproduces the table.
"""

import argparse
import os
import shlex
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", "-E", type=int, nargs="+", default=[64])
    p.add_argument("--top-k", "-k", type=int, nargs="+", default=[8])
    p.add_argument("--hidden", "-H", type=int, default=512)
    p.add_argument("--ffn", "-F", type=int, default=256)
    p.add_argument("--tokens-per-device", "-T", type=int, nargs="+", default=[2048])
    p.add_argument("--ep", type=int, default=8, help="expert-parallel size = emulated devices")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], nargs="+", default=["float32"])
    p.add_argument("--chunk", type=int, default=None, help="ring chunk (default: balanced share)")
    p.add_argument("--paper", action="store_true",
                   help="the issue's target: E=128, k=8 and 16, H=2048, F=768, T=61440, f32+bf16 "
                        "(implies --compile-only)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile from abstract shapes, allocate nothing (paper-size shapes)")
    p.add_argument("--time", action="store_true",
                   help="also time fwd+bwd: median of --runs runs after warm-up, as ratios")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["ring", "a2a-dropless", "a2a-cap1.0"],
                   choices=["ring", "a2a-dropless", "a2a-cap1.0"])
    a = p.parse_args(argv)
    if a.paper:
        a.experts, a.top_k, a.hidden, a.ffn = [128], [8, 16], 2048, 768
        a.tokens_per_device, a.dtype, a.compile_only = [61440], ["float32", "bfloat16"], True
    if a.time and a.compile_only:
        p.error("--time needs real arrays; drop --compile-only/--paper")
    return a


def shapes(args):
    from relaymoe_jax.memory import LayerShape
    for dtype in args.dtype:
        for e in args.experts:
            for k in args.top_k:
                for t in args.tokens_per_device:
                    yield LayerShape(e, k, args.hidden, args.ffn, t, args.ep, dtype, args.chunk)


def time_fwdbwd(shape, mesh, variant, runs):
    """Median seconds of one jitted fwd+bwd call (after one warm-up), uniform random routing."""
    import time

    import jax
    import numpy as np

    from relaymoe_jax import memory

    _, fwdbwd = memory.layer_fns(shape, mesh, variant)
    rng = np.random.default_rng(0)
    t = shape.tokens_per_device * shape.ep
    ids = np.argsort(rng.random((t, shape.experts)), axis=1)[:, :shape.top_k].astype(np.int32)
    abstract = memory.abstract_args(shape, mesh)
    arrays = [rng.standard_normal(a.shape) * 0.05 for a in abstract]
    arrays[1], arrays[2] = ids, rng.uniform(0.1, 1.0, ids.shape)
    args = [jax.device_put(np.asarray(v, a.dtype), a.sharding) for v, a in zip(arrays, abstract)]
    fn = jax.jit(fwdbwd)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    args = parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.ep}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging

    import jax

    from relaymoe_jax import memory

    logging.getLogger("relaymoe_jax").setLevel(logging.ERROR)   # capacity warnings: we know
    cmd = " ".join(shlex.quote(a) for a in ["python", sys.argv[0], *(argv or sys.argv[1:])])
    print(f"# reproduce: {cmd}")
    print(f"# jax {jax.__version__}, {jax.device_count()} emulated CPU devices; per-device "
          "temp_size_in_bytes from compiled.memory_analysis(); MiB = 2^20 bytes")
    mesh = jax.make_mesh((args.ep,), ("expert",))
    head = ("E", "k", "H", "F", "T/dev", "EP", "dtype", "dispatcher", "fwd MiB", "fwd+bwd MiB",
            "x ring", "[T*k,H] units", "floor MiB", "x floor")
    if args.time:
        head += ("fwd+bwd ms", "time x ring")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for s in shapes(args):
        got = {v: memory.measure_layer(s, mesh, v) for v in args.variants}
        secs = {}
        if args.time:
            # Emulated devices share this host's memory: refuse rather than be OOM-killed.
            need = args.ep * max(m["fwdbwd"] for m in got.values())
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > 0.7 * have:
                sys.exit(f"--time at this shape needs ~{need / 2**30:.1f} GiB of host memory "
                         f"({args.ep} devices x the largest fwd+bwd temp), this machine has "
                         f"{have / 2**30:.1f} GiB: choose a smaller shape or drop --time")
            secs = {v: time_fwdbwd(s, mesh, v, args.runs) for v in args.variants}
        ring = got.get("ring")
        unit = memory.expanded_bytes(s)
        for v, m in got.items():
            floor = memory.ring_floor_bytes(s) if v == "ring" else None
            cells = [s.experts, s.top_k, s.hidden, s.ffn, s.tokens_per_device, s.ep, s.dtype, v,
                     f"{memory.mib(m['fwd']):,.1f}", f"{memory.mib(m['fwdbwd']):,.1f}",
                     f"{m['fwdbwd'] / ring['fwdbwd']:.2f}" if ring else "-",
                     f"{m['fwdbwd'] / unit:.2f}",
                     f"{memory.mib(floor):,.1f}" if floor else "",
                     f"{m['fwdbwd'] / floor:.2f}" if floor else ""]
            if args.time:
                cells += [f"{secs[v] * 1e3:,.1f}",
                          f"{secs[v] / secs['ring']:.2f}" if "ring" in secs else "-"]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
