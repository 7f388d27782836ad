"""The `## MoE layer` and `## One ring hop` sections of benchmarks/gpu.py: moe_ffn fwd+bwd on one
device (ring vs all-to-all: compiled temp bytes, run peak, time) with the default grouped matmul,
and the compute of one hop of the paper's ring at two chunk sizes with each grouped matmul."""

import dataclasses
import math

from gpu_common import error_text, mib, num, print_head, print_row, relerr, timed

from relaymoe_jax.analysis import costmodel

LAYER = dict(experts=16, top_k=8, hidden=2048, ffn=768, tokens=8192)
TINY_LAYER = dict(experts=4, top_k=2, hidden=32, ffn=32, tokens=64)
LAYER_VARIANTS = ("ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0")  # memory.VARIANTS
# One hop of the paper's ring on one device: `experts` local experts (of experts * ep), `tokens`
# = the paper's tokens per device / ep, so tokens * top_k = the hop's balanced share of pairs.
# `chunk`: the smaller chunk timed (None: dispatch.chunking.default_chunk at the paper shape).
HOP = dict(experts=16, top_k=8, hidden=2048, ffn=768, tokens=7_680, ep=8, chunk=None)
TINY_HOP = dict(experts=4, top_k=2, hidden=32, ffn=32, tokens=64, ep=8, chunk=32)


# The hop's grouped matmuls, per chunk (default, balanced share): ours on Mosaic GPU and on
# Triton at both, lax.ragged_dot (XLA's, the anchor a user would otherwise take) at the default.
# Under --interpret (a CPU check that the script runs) the Triton kernel's interpreter only: the
# Mosaic GPU interpreter runs every SM's program in turn, many times slower, and its ring hops
# are tested in tests/test_dispatch_mosaic.py.
HOP_IMPLS = {True: ("mosaic", "pallas", "ragged_dot"), False: ("mosaic", "pallas")}
HOP_INTERPRET_IMPL = "pallas-interpret"
FP8_INTERPRET_IMPL = "xla"  # --interpret's FP8 row: XLA's grouped matmul, not a second interpreter


def _moe_impl(opts):
    """Holds the layer's gmm_impl: "auto" (what a user gets: our Mosaic GPU kernel on Hopper, the
    Triton one on other GPUs); with --interpret the blocked "xla" (the kernels' interpreters run
    in the hop and kernel sections)."""
    return "xla" if opts.interpret else "auto"


def _auto_impl(opts, mesh) -> str:
    """The gmm_impl "auto" resolves to for bf16 on `mesh` (its interpreter under --interpret)."""
    import jax.numpy as jnp

    from relaymoe_jax.kernels.gmm import resolve_impl

    impl = resolve_impl("auto", interpret=opts.interpret, mesh=mesh, dtypes=(jnp.bfloat16,))
    return f"{impl}-interpret" if opts.interpret else impl


def _one_device():
    """Holds (device, its 1-device mesh over axis "expert", the sharding of that axis)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("expert",))
    return dev, mesh, NamedSharding(mesh, P("expert"))


def layer_inputs(shp, sharding):
    """Holds moe_ffn's bf16 inputs (x, ids, weights, w_gate, w_up, w_down) for shape `shp`:
    each token routed to `top_k` distinct random experts, router weights normalised."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 5)
    wts = rng.uniform(0.1, 1.0, (t, k))
    host = [
        jax.random.normal(keys[0], (t, h)),
        ids,
        wts / wts.sum(1, keepdims=True),
        jax.random.normal(keys[1], (e, h, f)) / math.sqrt(h),
        jax.random.normal(keys[2], (e, h, f)) / math.sqrt(h),
        jax.random.normal(keys[3], (e, f, h)) / math.sqrt(f),
    ]
    return [
        jax.device_put(jnp.asarray(a, jnp.int32 if i == 1 else jnp.bfloat16), sharding)
        for i, a in enumerate(host)
    ]


def layer_fns(kw, stats=True):
    """Holds (fwd, fwdbwd) of moe_ffn(**kw), both taking (x, ids, wts, wg, wu, wd): fwd gives
    (y, stats) (y alone with stats=False), fwdbwd the loss 0.5*|y|^2 and its gradients."""
    import jax
    import jax.numpy as jnp

    from relaymoe_jax import moe_ffn

    fwd = lambda x, ids, wts, wg, wu, wd: moe_ffn(x, ids, wts, wg, wu, wd, return_stats=stats, **kw)

    def loss(x, wts, wg, wu, wd, ids):
        y = moe_ffn(x, ids, wts, wg, wu, wd, **kw).astype(jnp.float32)
        return 0.5 * jnp.sum(y * y)  # dy = y: a real [T, H] cotangent

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    return fwd, lambda x, ids, wts, wg, wu, wd: grad(x, wts, wg, wu, wd, ids)


def _compile(fn, args):
    import jax

    from relaymoe_jax import XLA_OPTIONS

    return jax.jit(fn).lower(*args).compile(compiler_options=XLA_OPTIONS)


LAYER_COLS = (
    "variant",
    "fwd temp MiB",
    "fwd+bwd temp MiB",
    "run peak MiB",
    "fwd+bwd ms",
    "expert TFLOP/s",
    "dropped pairs",
    "y rel. diff vs ring-expert",
)


def layer_section(opts, budget, results):
    """moe_ffn fwd+bwd on a 1-device mesh: ring (expert, token) vs alltoall (dropless, cap 1.0).

    Peak memory: `memory_stats()["peak_bytes_in_use"]` is a process-wide high-water mark that
    cannot be reset. So every variant is compiled first (its temp size measured), then the
    variants run in ascending order of fwd+bwd temp size, each on the same resident inputs: a
    variant that raises the high-water mark gets `peak - bytes in use before it ran` (its
    transient peak over the inputs); one that does not gets "<= " the previous mark's value,
    an upper bound only.
    """
    import numpy as np

    from relaymoe_jax.analysis import memory

    shp = dict(TINY_LAYER if opts.tiny else LAYER)
    shp["tokens"] = opts.layer_tokens or shp["tokens"]
    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    impl = _moe_impl(opts)
    dev, mesh, sharding = _one_device()
    named = f"{impl!r}" + (f" = {_auto_impl(opts, mesh)!r}" if impl == "auto" else "")
    print(
        f"\n## MoE layer fwd+bwd on one device: E={e} k={k} H={h} F={f} T={t} bf16, "
        f"gmm_impl={named}\n"
    )
    args = layer_inputs(shp, sharding)
    stats = lambda: dev.memory_stats() or {}
    print(
        "# temp MiB: compiled.memory_analysis().temp_size_in_bytes (compile-only); run peak "
        "MiB: memory_stats() peak_bytes_in_use during the variant's runs minus bytes in use "
        "before (variants run in ascending temp order; '<= x': no new high-water mark, an "
        "upper bound; n/a: no memory_stats on this backend); MiB = 2^20 bytes; expert "
        "TFLOP/s = 18*T*k*H*F / time, every routed pair counted (a2a-cap1.0 computes fewer: "
        "its dropped pairs)",
        flush=True,
    )
    compiled, errors = {}, {}
    for v in LAYER_VARIANTS:
        try:
            fwd, fwdbwd = layer_fns(
                dict(memory.VARIANTS[v], mesh=mesh, expert_axis="expert", gmm_impl=impl)
            )
            c_fwd, c_all = _compile(fwd, args), _compile(fwdbwd, args)
            compiled[v] = (c_fwd, c_all, c_fwd.memory_analysis(), c_all.memory_analysis())
        except Exception as ex:
            errors[v] = f"error: {error_text(ex)}"
    temp = lambda ma: ma.temp_size_in_bytes if ma is not None else None
    order = sorted(compiled, key=lambda v: temp(compiled[v][3]) or 0)
    print_head(LAYER_COLS)
    flops, rows, ys = 18.0 * t * k * h * f, {}, {}
    for v in order:
        c_fwd, c_all, ma_fwd, ma_all = compiled[v]
        cells = [
            v,
            mib(temp(ma_fwd)) if ma_fwd else "n/a",
            mib(temp(ma_all)) if ma_all else "n/a",
        ]
        if budget.over():
            rows[v] = [*cells, f"skipped: time budget of {budget.minutes} min", "", "", ""]
            continue
        try:
            before = stats()
            y, st = c_fwd(*args)
            ys[v] = np.asarray(y, np.float64)
            dropped = int(st["dropped_pairs"])
            del y, st
            _, secs = timed(c_all, args, opts, keep=False)
            after = stats()
            if "peak_bytes_in_use" in after and "bytes_in_use" in before:
                new_mark = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
                peak_txt = (
                    mib(after["peak_bytes_in_use"] - before["bytes_in_use"])
                    if new_mark
                    else f"<= {mib(before['peak_bytes_in_use'] - before['bytes_in_use'])}"
                )
            else:
                peak_txt = "n/a"
            rows[v] = [*cells, peak_txt, num(secs * 1e3), num(flops / secs / 1e12), dropped]
        except Exception as ex:
            rows[v] = [*cells, f"error: {error_text(ex)}", "", "", ""]
    for v in LAYER_VARIANTS:  # printed together: the last column needs ring-expert's output
        if v in errors:
            cells = [v, errors[v], "", "", "", "", "", ""]
        else:
            ref = ys.get("ring-expert")
            diff = (
                num(relerr(ys[v], ref), 3)
                if v in ys and ref is not None
                else "n/a"
                if v in ys
                else ""
            )
            cells = [*rows[v], diff]
        print_row(cells)
        results.layer.append(dict(zip(LAYER_COLS, (str(c) for c in cells))))


# ---------------------------------------------------------------- one ring hop


@dataclasses.dataclass(frozen=True)
class HopTiming:
    """One hop at one chunk size (a JSON row); the times None when it failed."""

    chunk: int
    default_chunk: bool  # the ring's default chunk at the paper shape
    pairs: int
    experts: int
    top_k: int
    hidden: int
    ffn: int
    fwd_ms: float | None
    bwd_ms: float | None
    fwd_tflops: float | None
    bwd_tflops: float | None
    error: str | None = None
    impl: str = "pallas"  # the hop's gmm_impl (files before 2026-12-07: the Triton kernel)
    default_impl: bool = True  # the one gmm_impl="auto" picks on this device
    fp8: bool = False  # expert_fp8 (the FP8 recipe; files before 2026-12-07 have no such rows)


def hop_chunks(shp):
    """Holds [(chunk, is the default)]: the default chunk at the paper shape, then the balanced
    share (one chunk; the old default)."""
    from relaymoe_jax.dispatch.chunking import balanced_share, default_chunk

    ring_tokens, ep = shp["tokens"] * shp["ep"], shp["ep"]
    share = balanced_share(ring_tokens, shp["top_k"], ep)
    small = shp["chunk"] or default_chunk(ring_tokens, shp["top_k"], ep, shp["experts"] * ep)
    return [(small, True), (share, False)]


def time_hop(shp, chunk, mesh, args, impl, opts, fp8=False):
    """Holds (fwd s, fwd+bwd s) of the ring's one hop at `chunk` pairs per chunk."""
    fwd, fwdbwd = layer_fns(
        dict(
            dispatcher="ring",
            routing="expert",
            mesh=mesh,
            expert_axis="expert",
            gmm_impl=impl,
            chunk_size=chunk,
            expert_fp8=fp8,
        ),
        stats=False,
    )
    _, t_fwd = timed(_compile(fwd, args), args, opts, keep=False)
    _, t_all = timed(_compile(fwdbwd, args), args, opts, keep=False)
    return t_fwd, t_all


HOP_COLS = (
    "chunk (pairs)",
    "gmm_impl",
    "chunks per hop",
    "fwd ms",
    "bwd ms",
    "fwd+bwd ms",
    "fwd TFLOP/s",
    "bwd TFLOP/s",
)


def hop_cases(shp, opts, auto):
    """Holds [(chunk, is the default chunk, gmm_impl, expert_fp8)] in the order timed: the
    default chunk's impls, then the balanced share's (`HOP_IMPLS`), then the default chunk with
    `auto`'s impl and expert_fp8 (the FP8 recipe; its matmuls are the 16-bit kernel's on the
    rounded values until an e4m3 kernel exists: this row is what the rounding costs; under
    --interpret with `FP8_INTERPRET_IMPL`)."""
    bf16 = [
        (chunk, is_default, impl, False)
        for chunk, is_default in hop_chunks(shp)
        for impl in ((HOP_INTERPRET_IMPL,) if opts.interpret else HOP_IMPLS[is_default])
    ]
    fp8_impl = FP8_INTERPRET_IMPL if opts.interpret else auto  # interpreted: the plumbing only
    return [*bf16, (hop_chunks(shp)[0][0], True, fp8_impl, True)]


def impl_label(impl: str, fp8: bool) -> str:
    """The hop table's gmm_impl cell."""
    return impl + (" + expert_fp8" if fp8 else "")


def hop_section(opts, budget, results):
    """One hop of the paper's ring on one device, at the default chunk and at one chunk, with each
    grouped matmul (`hop_cases`)."""
    shp = TINY_HOP if opts.tiny else HOP
    e, k, h, f, t = (shp[x] for x in ("experts", "top_k", "hidden", "ffn", "tokens"))
    pairs = t * k
    _, mesh, sharding = _one_device()
    auto = _auto_impl(opts, mesh)
    print(
        f"\n## One ring hop: E_l={e} local experts (E={e * shp['ep']} over EP={shp['ep']}), "
        f"k={k}, H={h}, F={f}, bf16, {pairs:,} pairs (T={t * shp['ep']:,} per device / EP; "
        f"{t:,} tokens on one device), each gmm_impl (gmm_impl='auto' here: {auto!r})\n"
    )
    flop_f, flop_b = costmodel.hop_flops(pairs, h, f)
    print(
        f"# moe_ffn(dispatcher='ring', routing='expert', chunk_size=chunk, gmm_impl=...) under "
        f"jit on a 1-device mesh; bwd = fwd+bwd - fwd; TFLOP/s: {costmodel.HOP_FWD_UNITS}*pairs"
        f"*H*F / fwd, {costmodel.HOP_BWD_UNITS}*pairs*H*F / bwd (the recompute not counted)",
        flush=True,
    )
    args = layer_inputs(shp, sharding)
    print_head(HOP_COLS)
    for chunk, is_default, impl, fp8 in hop_cases(shp, opts, auto):
        rec = dict(
            chunk=chunk,
            default_chunk=is_default,
            pairs=pairs,
            experts=e,
            top_k=k,
            hidden=h,
            ffn=f,
            impl=impl,
            default_impl=impl == auto,
            fp8=fp8,
        )
        label = f"{chunk:,}" + (" (default)" if is_default else " (balanced share)")
        failed = dict(fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None)
        if budget.over():
            why = f"skipped: time budget of {budget.minutes} min"
            results.hop.append(HopTiming(**rec, **failed, error=why))
            print_row([label, impl_label(impl, fp8), "", why, "", "", "", ""])
            continue
        try:
            t_fwd, t_all = time_hop(shp, chunk, mesh, args, impl, opts, fp8)
        except Exception as ex:
            results.hop.append(HopTiming(**rec, **failed, error=error_text(ex)))
            print_row(
                [label, impl_label(impl, fp8), "", f"error: {error_text(ex)}", "", "", "", ""]
            )
            continue
        t_bwd = t_all - t_fwd
        tf_b = flop_b / t_bwd / 1e12 if t_bwd > 0 else None
        results.hop.append(
            HopTiming(
                **rec,
                fwd_ms=t_fwd * 1e3,
                bwd_ms=t_bwd * 1e3,
                fwd_tflops=flop_f / t_fwd / 1e12,
                bwd_tflops=tf_b,
            )
        )
        print_row(
            [
                label,
                impl_label(impl, fp8),
                -(-pairs // chunk),
                num(t_fwd * 1e3),
                num(t_bwd * 1e3),
                num(t_all * 1e3),
                num(flop_f / t_fwd / 1e12),
                num(tf_b) if tf_b is not None else "n/a (fwd+bwd <= fwd)",
            ]
        )
