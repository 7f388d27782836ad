"""Per-device memory, ring traffic and (optionally) time of one MoE layer: ring vs all-to-all.

Memory is XLA's own buffer assignment (`compiled.memory_analysis()`), per device, on emulated CPU
devices, or with `--target h100|h200` on abstract GPUs: the XLA:GPU compiler's buffer assignment
for an 8-GPU node, compiled without a GPU (`relaymoe_jax.gpu_mesh`, the `gpu-compile` extra), bf16,
with the grouped matmul `--gmm-impl` names ("auto": our Mosaic GPU kernel on H100/H200; the
header names it). Ring traffic is read from the compiled HLO: the bytes of the
collective permutes in one iteration of the forward ring loop and of the backward ring loop, next
to the paper's Table 2 prediction. Run `python benchmarks/moe_layer.py --help`; the first output
line is the command that reproduces the table. No timing is possible with --target.

Without shape flags (or --target, --paper, --modes) it measures a small shape that compiles on a
CPU host in seconds (E=64, k=8, H=512, F=256, 2,048 tokens per device, float32 on 8 emulated
devices), not the paper's. The paper's layer (Qwen3-30B-A3B's experts: E=128, k=8 and 16,
H=2048, F=768, 61,440 tokens per device) is `--target h100` (the XLA:GPU compiler's buffer
assignment for 8 H100s, bf16, no GPU needed: the README's headline) or `--paper` (XLA:CPU's,
f32 and bf16, compile only).
"""

import argparse
import os
import shlex
import sys

from relaymoe_jax.cli.argtypes import positive_int
from relaymoe_jax.dispatch.activation import ACTIVATIONS

GMM_IMPLS = ("auto", "mosaic", "pallas", "xla", "ragged_dot")  # compiled ones (no interpreters)

VARIANTS = ("ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0")  # = memory.VARIANTS
# Paper §4.5's 384-expert configs (H = F = 2048 at 20K tokens) and E128 k8 (Qwen3-30B-A3B's
# experts at long sequence), with H, F and tokens scaled by 1/8 so they run on a CPU host: weights
# shrink 64x, tokens 8x, so token routing's advantage at E384 shrinks 8x but keeps its side.
MODES_PRESET = [(384, 12, 256, 256, 2560), (384, 16, 256, 256, 2560), (128, 8, 256, 96, 16384)]
# --target's default shapes, full size: the paper shape (Qwen3-30B-A3B's experts, 61,440 tokens
# per device) at k=8 and 16, and paper §4.5's 384-expert configs (H = F = 2048, 20K tokens).
GPU_PRESET = [
    (128, 8, 2048, 768, 61440),
    (128, 16, 2048, 768, 61440),
    (384, 12, 2048, 2048, 20480),
    (384, 16, 2048, 2048, 20480),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts", "-E", type=positive_int, nargs="+", default=None, help="default 64")
    p.add_argument("--top-k", "-k", type=positive_int, nargs="+", default=None, help="default 8")
    p.add_argument("--hidden", "-H", type=positive_int, default=None, help="default 512")
    p.add_argument("--ffn", "-F", type=positive_int, default=None, help="default 256")
    p.add_argument(
        "--tokens-per-device", "-T", type=positive_int, nargs="+", default=None, help="default 2048"
    )
    p.add_argument(
        "--ep", type=positive_int, default=8, help="expert-parallel size = devices (default 8)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        nargs="+",
        default=None,
        help="default float32 (bfloat16 with --target)",
    )
    p.add_argument(
        "--target",
        choices=["h100", "h200"],
        default=None,
        help="compile for abstract GPUs (XLA:GPU, no GPU needed; implies "
        "--compile-only). Without shape flags: the full-size shapes "
        + ", ".join(str(c) for c in GPU_PRESET)
        + " (E, k, H, F, T/dev)",
    )
    p.add_argument(
        "--chunk", type=positive_int, default=None, help="ring chunk (default: balanced share)"
    )
    p.add_argument(
        "--activation",
        choices=ACTIVATIONS,
        default="swiglu",
        help="the experts' gated activation (default swiglu; gpt_oss: GPT-OSS's clamped SwiGLU)",
    )
    p.add_argument(
        "--biases",
        action="store_true",
        help="the experts have b_gate, b_up and b_down (GPT-OSS); their gradients are taken too",
    )
    p.add_argument(
        "--paper",
        action="store_true",
        help="the paper's layer (Qwen3-30B-A3B's experts): E=128, k=8 and 16, H=2048, F=768, "
        "T=61440, f32+bf16, on the emulated CPU devices (implies --compile-only; --target "
        "h100 for the GPU compiler's figures)",
    )
    p.add_argument(
        "--modes",
        action="store_true",
        help="routing-mode configs (E, k, H, F, T/dev): "
        + ", ".join(str(c) for c in MODES_PRESET)
        + "; paper §4.5 scaled by 1/8",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile from abstract shapes, allocate nothing (paper-size shapes)",
    )
    p.add_argument(
        "--time",
        action="store_true",
        help="also time fwd+bwd: median of --runs runs after warm-up, as ratios; a "
        "variant whose memory would not fit this host is skipped",
    )
    p.add_argument(
        "--gmm-impl",
        choices=GMM_IMPLS,
        default="auto",
        help="the grouped matmul of the ring and the all-to-alls (default auto: with --target "
        "our Mosaic GPU kernel, 'pallas' the Triton one; XLA's blocked one on CPU devices)",
    )
    p.add_argument(
        "--expert-fp8",
        action="store_true",
        help="moe_ffn(expert_fp8=True): the FP8 recipe (docs/precision.md); with --target the "
        "ring's grouped matmuls are the e4m3 kernel",
    )
    p.add_argument("--runs", type=positive_int, default=5, help="timed runs (default 5)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    a = p.parse_args(argv)
    shape_flags = (a.experts, a.top_k, a.hidden, a.ffn, a.tokens_per_device)
    a.gpu_preset = (
        a.target is not None and all(v is None for v in shape_flags) and not (a.paper or a.modes)
    )
    for name, default in (
        ("experts", [64]),
        ("top_k", [8]),
        ("hidden", 512),
        ("ffn", 256),
        ("tokens_per_device", [2048]),
    ):
        if getattr(a, name) is None:
            setattr(a, name, default)
    _check_presets(p, a, shape_flags)
    a.dtype = a.dtype or (["bfloat16"] if a.target else ["float32"])
    if a.target:
        if a.time:
            p.error("--time needs a real device; --target compiles for abstract GPUs only")
        a.compile_only = True
    if a.paper:
        a.experts, a.top_k, a.hidden, a.ffn = [128], [8, 16], 2048, 768
        a.tokens_per_device, a.dtype, a.compile_only = [61440], ["float32", "bfloat16"], True
    if a.time and a.compile_only:
        p.error("--time needs real arrays; drop --compile-only/--paper")
    if a.gmm_impl in ("mosaic", "pallas") and not a.target:
        p.error(
            f"--gmm-impl {a.gmm_impl} is a GPU kernel; without --target the layer compiles for "
            "the emulated CPU devices: add --target h100|h200, or use auto/xla/ragged_dot"
        )
    if a.gmm_impl == "ragged_dot" and a.time:
        p.error(
            "--gmm-impl ragged_dot with --time: lax.ragged_dot on CPU is a dense G-times "
            "emulation, not a grouped matmul worth timing; use auto or xla"
        )
    for s in shapes(a):
        if s.top_k > s.experts:
            p.error(f"--top-k {s.top_k} is more than --experts {s.experts}")
        if s.experts % s.ep:
            p.error(
                f"--experts {s.experts} does not split over --ep {s.ep} devices (expected a "
                f"multiple of {s.ep})"
            )
    return a


SHAPE_FLAGS = ("--experts", "--top-k", "--hidden", "--ffn", "--tokens-per-device")


def _check_presets(p, a, shape_flags):
    """--paper and --modes set the shapes (--paper its dtypes too): refuse flags they would
    override."""
    if a.paper and a.modes:
        p.error("--paper and --modes are two presets: choose one")
    given = [f for f, v in zip(SHAPE_FLAGS, shape_flags) if v is not None]
    if (a.paper or a.modes) and given:
        preset = "--paper" if a.paper else "--modes"
        p.error(f"{preset} sets the shapes, so {', '.join(given)} would be ignored: drop one")
    if a.paper and a.dtype:
        p.error("--paper measures float32 and bfloat16, so --dtype would be ignored: drop one")


def shapes(args):
    from relaymoe_jax.analysis.memory import LayerShape

    for dtype in args.dtype:
        if args.modes or args.gpu_preset:
            for e, k, h, f, t in MODES_PRESET if args.modes else GPU_PRESET:
                yield LayerShape(e, k, h, f, t, args.ep, dtype, args.chunk, args.biases)
            continue
        for e in args.experts:
            for k in args.top_k:
                for t in args.tokens_per_device:
                    yield LayerShape(
                        e, k, args.hidden, args.ffn, t, args.ep, dtype, args.chunk, args.biases
                    )


def time_fwdbwd(shape, mesh, variant, runs, extra=None):
    """Median seconds of one jitted fwd+bwd call (after one warm-up), uniform random routing."""
    import time

    import jax
    import numpy as np

    from relaymoe_jax.analysis import memory

    _, fwdbwd = memory.layer_fns(shape, mesh, variant, extra=extra)
    rng = np.random.default_rng(0)
    t = shape.tokens_per_device * shape.ep
    ids = np.argsort(rng.random((t, shape.experts)), axis=1)[:, : shape.top_k].astype(np.int32)
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


def fits_host(shape, measured, ep):
    """Emulated devices share this host's memory: time only what fits in 70% of it."""
    from relaymoe_jax.analysis import memory

    args = sum(a.size * a.dtype.itemsize for a in memory.abstract_args_unsharded(shape))
    need = ep * measured["fwdbwd"] + 3 * args
    return need <= 0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def layer_options(args) -> dict:
    """moe_ffn's options for every variant: the activation, gmm_impl, and expert_fp8 if asked."""
    extra = {"activation": args.activation, "gmm_impl": args.gmm_impl}
    return {**extra, "expert_fp8": True} if args.expert_fp8 else extra


def _fp8_note(args) -> str:
    return ", expert_fp8 (the experts' matmuls: gmm_fp8's e4m3 kernel)" if args.expert_fp8 else ""


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging
    import warnings

    import jax

    if jax.config.jax_platforms in (None, ""):  # jax is imported already (relaymoe_jax):
        jax.config.update("jax_platforms", "cpu")  # the env var above came too late

    from relaymoe_jax.analysis import gpu_mesh, memory
    from relaymoe_jax.cli.devices import use_cpu_devices
    from relaymoe_jax.kernels.gmm import describe_impl

    use_cpu_devices(args.ep)  # --ep emulated devices, unless XLA_FLAGS sets a device count

    logging.getLogger("relaymoe_jax").setLevel(logging.ERROR)  # capacity warnings: we know
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    cmd = " ".join(shlex.quote(a) for a in ["python", sys.argv[0], *(argv or sys.argv[1:])])
    print(f"# reproduce: {cmd}", flush=True)
    if args.target:
        try:
            mesh = gpu_mesh.mesh((args.ep,), ("expert",), target=args.target)
        except (gpu_mesh.PluginMissing, ValueError) as e:
            sys.exit(f"moe_layer.py: {e}")
        gib = gpu_mesh.device_memory(args.target) / 2**30
        print(
            f"# jax {jax.__version__}, XLA:GPU compiler for {args.ep} abstract "
            f"{gpu_mesh.device_kind(args.target)} ({gib:,.1f} "
            f"GiB each), no GPU: buffer assignment only, no timing; gmm_impl="
            f"{describe_impl(args.gmm_impl, mesh)}{_fp8_note(args)}; per-device "
            "temp_size_in_bytes from compiled.memory_analysis(); MiB = 2^20 bytes"
        )
        wire = "as the GPU program sends them: bf16 stays bf16"
    else:
        if jax.device_count() < args.ep:
            sys.exit(
                f"moe_layer.py: error: --ep {args.ep} needs {args.ep} devices, jax has "
                f"{jax.device_count()} (XLA_FLAGS sets another device count?)"
            )
        mesh = jax.make_mesh((args.ep,), ("expert",))
        print(
            f"# jax {jax.__version__}, {jax.device_count()} emulated CPU devices; per-device "
            "temp_size_in_bytes from compiled.memory_analysis(); MiB = 2^20 bytes"
        )
        wire = "XLA:CPU sends bf16 as f32"
    print(
        f"# hop KiB: bytes one device sends per ring hop, from the compiled HLO's collective "
        f"permutes ({wire}); Table 2: the paper's prediction. "
        "'x auto': this row / the ring mode routing='auto' picks (listed under the table)",
        flush=True,
    )
    if args.activation != "swiglu" or args.biases:
        with_b = " with expert biases b_gate, b_up, b_down (their gradients too)"
        print(f"# experts: activation={args.activation!r}{with_b if args.biases else ''}")
    head = (
        "E",
        "k",
        "H",
        "F",
        "T/dev",
        "dtype",
        "variant",
        "fwd MiB",
        "fwd+bwd MiB",
        "x auto",
        "[T*k,H] units",
        "x floor",
        "hop fwd KiB",
        "Table 2 fwd",
        "hop bwd KiB",
        "Table 2 bwd",
    )
    if args.time:
        head += ("fwd+bwd ms", "time x auto")
    if args.target:
        head += (f"fwd+bwd % of {args.target.upper()}",)
        device_bytes = gpu_mesh.device_memory(args.target)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    notes = []
    for s in shapes(args):
        vol = memory.table2(s)
        notes.append(
            f"- E{s.experts} k{s.top_k} H{s.hidden} F{s.ffn} T{s.tokens_per_device} "
            f"{s.dtype}: auto picks {vol.explain()}"
        )
        extra = layer_options(args)
        got = {v: memory.measure_layer(s, mesh, v, extra=extra) for v in args.variants}
        secs = {
            v: time_fwdbwd(s, mesh, v, args.runs, extra)
            for v in args.variants
            if args.time and fits_host(s, got[v], args.ep)
        }
        auto = f"ring-{vol.choice}"
        kib = lambda b: f"{b / 2**10:,.1f}"
        unit = memory.expanded_bytes(s)
        for v, m in got.items():
            mode = v.removeprefix("ring-") if v.startswith("ring") else None
            floor = memory.ring_floor_bytes(s, routing=mode) if mode else None
            pred = (getattr(vol, f"{mode}_fwd"), getattr(vol, f"{mode}_bwd")) if mode else None
            cells = [
                s.experts,
                s.top_k,
                s.hidden,
                s.ffn,
                s.tokens_per_device,
                s.dtype,
                v,
                f"{memory.mib(m['fwd']):,.1f}",
                f"{memory.mib(m['fwdbwd']):,.1f}",
                f"{m['fwdbwd'] / got[auto]['fwdbwd']:.2f}" if auto in got else "-",
                f"{m['fwdbwd'] / unit:.2f}",
                f"{m['fwdbwd'] / floor:.2f}" if floor else "",
                kib(m["hop_fwd"]) if mode else "",
                kib(pred[0]) if mode else "",
                kib(m["hop_bwd"]) if mode else "",
                kib(pred[1]) if mode else "",
            ]
            if args.time:
                cells += [
                    f"{secs[v] * 1e3:,.1f}" if v in secs else "(too big)",
                    f"{secs[v] / secs[auto]:.2f}" if v in secs and auto in secs else "-",
                ]
            if args.target:
                cells.append(f"{100 * m['fwdbwd'] / device_bytes:,.1f}")
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a shape the op refuses: its message, not a traceback
        sys.exit(f"moe_layer.py: error: {e}")
