"""The `## Attention` section of benchmarks/gpu.py: causal grouped-query attention fwd and
fwd+bwd at Qwen3-30B-A3B's heads, plain causal and with packed documents, for the Pallas Mosaic
GPU kernel (`kernels.attention.flash_attention`) and the chunked XLA path
(`models.attention.chunked_causal_attention`); the kernel checked against the chunked path."""

import dataclasses
import time

from gpu_common import TOL, error_text, num, print_head, print_row, relerr, timed

# Qwen3-30B-A3B: 32 query heads, 4 kv heads, head_dim 128; tokens per device; documents of `doc`
ATTN = dict(heads=32, kv_heads=4, head_dim=128, tokens=(8192, 32768, 131072), doc=4096, block_k=512)
TINY_ATTN = dict(heads=4, kv_heads=2, head_dim=64, tokens=(128,), doc=64, block_k=64)
IMPLS = ("pallas", "chunked")
BWD_UNITS = 2.5  # bwd FLOPs / fwd FLOPs: FlashAttention's convention (5 matmuls vs 2)
# A cell is skipped when the budget left cannot hold its calls (2 of fwd and 2 of fwd+bwd when
# long, else 5) at the seconds per FLOP of the impl's previous cell (at first: these rates in fwd
# + fwd+bwd FLOPs per second), plus COMPILE_S; not with --interpret (whose times say nothing).
SLOW_RATE = {"pallas": 150e12, "chunked": 40e12}
COMPILE_S = 5.0
LONG_FLOPS = 2e13  # a chunked cell with more fwd FLOPs is timed with 1 warm-up and 1 run


def visible_pairs(s: int, doc):
    """Holds the (query, key) pairs the causal rule (and the documents of `doc` tokens) keep."""
    if not doc:
        return s * (s + 1) // 2
    full, rest = divmod(s, doc)
    return full * doc * (doc + 1) // 2 + rest * (rest + 1) // 2


@dataclasses.dataclass(frozen=True)
class AttnTiming:
    """One implementation on one shape (a JSON row); figures None when it failed or was skipped;
    err: the kernel vs the chunked path (o, dq, dk, dv), None for the chunked path itself."""

    tokens: int
    documents: int | None
    impl: str
    heads: int
    kv_heads: int
    head_dim: int
    fwd_flops: float
    fwd_ms: float | None
    bwd_ms: float | None
    fwd_tflops: float | None
    bwd_tflops: float | None
    err: list | None
    error: str | None = None


def _inputs(shp, s, doc):
    """Holds (q, k, v, do, token index [1, S], segment ids [1, S] or None): bf16 normals."""
    import jax
    import jax.numpy as jnp

    n, kh, d = shp["heads"], shp["kv_heads"], shp["head_dim"]
    kq, kk, kv, kd = jax.random.split(jax.random.key(s + (doc or 0)), 4)
    idx = jnp.arange(s, dtype=jnp.int32)[None]
    return (
        jax.random.normal(kq, (1, s, n, d), jnp.bfloat16),
        jax.random.normal(kk, (1, s, kh, d), jnp.bfloat16),
        jax.random.normal(kv, (1, s, kh, d), jnp.bfloat16),
        jax.random.normal(kd, (1, s, n, d), jnp.bfloat16),
        idx,
        None if doc is None else idx // doc,
    )


def attn_fns(impl, shp, interpret):
    """Holds jitted (fwd, fwdbwd) of one impl, both taking (q, k, v, do, idx, seg): fwd gives
    o, fwdbwd (dq, dk, dv) of the loss sum(o * do)."""
    import jax

    if impl == "pallas":
        from relaymoe_jax.kernels.attention import flash_attention

        f = lambda q, k, v, idx, seg: flash_attention(
            q, k, v, idx, idx, seg, seg, interpret=interpret
        )
    else:
        from relaymoe_jax.models.attention import chunked_causal_attention

        f = lambda q, k, v, idx, seg: chunked_causal_attention(
            q, k, v, block_k=shp["block_k"], segment_ids=seg
        )

    def fwdbwd(q, k, v, do, idx, seg):
        _, pull = jax.vjp(lambda q, k, v: f(q, k, v, idx, seg), q, k, v)
        return pull(do)

    return jax.jit(lambda q, k, v, do, idx, seg: f(q, k, v, idx, seg)), jax.jit(fwdbwd)


def _rows(s, doc, n_check):
    """Holds the sorted sequence positions the error check reads: evenly spaced, plus each
    document's first and last token."""
    import numpy as np

    if s <= n_check:
        return np.arange(s)
    edges = [] if not doc else [x for a in range(0, s, doc) for x in (a, min(a + doc, s) - 1)]
    return np.unique(np.concatenate([np.linspace(0, s - 1, n_check).astype(np.int64), edges]))


def _sampled(out, rows):
    """Holds the outputs' rows (axis 1) as float64 numpy arrays."""
    import jax.numpy as jnp
    import numpy as np

    return [np.asarray(jnp.take(x, rows, axis=1), np.float64) for x in out]


def time_impl(impl, shp, args, rows, opts):
    """Holds (fwd s or error text, fwd+bwd s or error text, sampled [o, dq, dk, dv] or None)."""
    fwd, fwdbwd = attn_fns(impl, shp, opts.interpret)
    got, res = [None, None], []
    for i, fn in enumerate((fwd, fwdbwd)):
        try:
            compiled = fn.lower(*args).compile()
            out, secs = timed(compiled, args, opts)
            got[i] = _sampled([out] if i == 0 else out, rows)
            del out
            res.append(secs)
        except Exception as ex:
            res.append(f"error: {error_text(ex)}")
    samples = None if got[0] is None else got[0] + (got[1] or [None] * 3)
    return res[0], res[1], samples


ATTN_COLS = (
    "tokens",
    "documents",
    "impl",
    "fwd ms",
    "bwd ms",
    "fwd TFLOP/s",
    "bwd TFLOP/s",
    "% peak fwd / bwd",
    "err o / dq / dk / dv",
    "check",
)


def _errors(samples, ref):
    """Holds [err of o, dq, dk, dv] (None where either side is missing) of samples vs ref."""
    if samples is None or ref is None:
        return None
    return [None if g is None or r is None else relerr(g, r) for g, r in zip(samples, ref)]


def _row(impl, t_fwd, t_all, flops, errs, peak):
    """Holds (cells after tokens and documents, figures for AttnTiming)."""
    ok = not isinstance(t_fwd, str)
    t_bwd = t_all - t_fwd if ok and not isinstance(t_all, str) else None
    tf_f = flops / t_fwd / 1e12 if ok else None
    tf_b = BWD_UNITS * flops / t_bwd / 1e12 if t_bwd and t_bwd > 0 else None
    bwd_txt = num(t_bwd * 1e3) if t_bwd is not None else ""
    if t_bwd is None and isinstance(t_all, str) and t_all != t_fwd:
        bwd_txt = t_all  # the fwd+bwd's error (a skip already shows in the fwd cell)
    bwd_tf = num(tf_b) if tf_b else ("n/a (fwd+bwd <= fwd)" if t_bwd is not None else "")
    pct = " / ".join(f"{100 * x / peak:.1f}" if x and peak else "n/a" for x in (tf_f, tf_b))
    pct = pct if ok else ""
    if impl == "chunked":
        err_txt, check = "reference" if ok else "", "-"
    elif errs is None:
        err_txt, check = "n/a (no reference)" if ok else "", "-"
    else:
        err_txt = " / ".join("-" if e is None else num(e, 3) for e in errs)
        check = "ok" if None not in errs and max(errs) <= TOL else "ERR > tol"
    cells = [
        num(t_fwd * 1e3) if ok else t_fwd,
        bwd_txt,
        num(tf_f) if ok else "",
        bwd_tf,
        pct,
        err_txt,
        check,
    ]
    figs = dict(
        fwd_ms=t_fwd * 1e3 if ok else None,
        bwd_ms=t_bwd * 1e3 if t_bwd is not None else None,
        fwd_tflops=tf_f,
        bwd_tflops=tf_b,
        err=errs if impl == "pallas" else None,
        error=next((t for t in (t_fwd, t_all) if isinstance(t, str)), None),
    )
    return cells, figs


def _skip_reason(impl, flops, long, pace, budget, opts):
    """Holds why this cell is skipped (the budget is spent or cannot hold it), or None; `pace`:
    {impl: seconds of one fwd and one fwd+bwd call per fwd FLOP, measured on its last cell}."""
    left = budget.end - time.monotonic()
    per_flop = pace.get(impl, (2 + BWD_UNITS) / SLOW_RATE[impl])
    need = 0.0 if opts.interpret else COMPILE_S + (2 if long else 5) * per_flop * flops
    if budget.over():
        return f"skipped: time budget of {budget.minutes} min reached"
    if left < need:
        return f"skipped: needs ~{need:.0f} s, {left:.0f} s of the budget left"
    return None


def _cases(shp):
    """Holds (tokens, documents) in the order run: per token count, documents first (cheaper),
    so the costliest case (the most tokens, plain causal) comes last."""
    return [(s, doc) for s in shp["tokens"] for doc in (shp["doc"], None)]


def attention_section(opts, peak, budget, results):
    shp = TINY_ATTN if opts.tiny else ATTN
    n, kh, d = shp["heads"], shp["kv_heads"], shp["head_dim"]
    print(
        f"\n## Attention: causal GQA, N={n} query heads, K={kh} kv heads, head_dim {d}, bf16, "
        f"batch 1, fwd and fwd+bwd\n"
    )
    print(
        "# pallas: kernels.attention.flash_attention"
        + (" (interpret=True)" if opts.interpret else "")
        + f"; chunked: models.attention.chunked_causal_attention(block_k={shp['block_k']}); "
        f"documents: packed documents of that many tokens (segment ids); bwd = fwd+bwd - fwd; "
        f"fwd FLOPs = 4*N*D*(visible pairs: S(S+1)/2 causal, sum of L(L+1)/2 over documents), "
        f"bwd FLOPs = {BWD_UNITS} x fwd (FlashAttention's convention); % peak of "
        + (f"{peak} TFLOP/s" if peak else "n/a (peak unknown)")
        + f"; err: max|x - chunked| / max|chunked| on up to {opts.check_rows} sampled positions, "
        f"tolerance {TOL}; chunked cells over {LONG_FLOPS:.0e} fwd FLOPs: 1 warm-up, 1 run",
        flush=True,
    )
    print_head(ATTN_COLS)
    pace = {}
    for s, doc in _cases(shp):
        if not _case(s, doc, shp, opts, peak, budget, results, pace):
            return


def _short(opts):
    """Holds opts with 1 warm-up call and 1 timed run (a long chunked cell)."""
    import argparse

    return argparse.Namespace(**{**vars(opts), "warmup": 1, "runs": 1})


def _case(s, doc, shp, opts, peak, budget, results, pace):
    """Times both impls on one shape and prints their rows; holds False once the budget is spent."""
    n, kh, d = shp["heads"], shp["kv_heads"], shp["head_dim"]
    flops = 4.0 * n * d * visible_pairs(s, doc)
    label = [f"{s:,}", "none" if doc is None else f"{doc:,}"]
    if budget.over():
        print(
            f"# skipped {label[0]} tokens, documents {label[1]}, and the rest: time budget of "
            f"{budget.minutes} min reached",
            flush=True,
        )
        return False
    try:
        args = _inputs(shp, s, doc)
        rows = _rows(s, doc, opts.check_rows)
    except Exception as ex:
        print(f"# {label[0]} tokens, documents {label[1]}: error: {error_text(ex)}", flush=True)
        return True
    runs = {}
    for impl in IMPLS:
        long = impl == "chunked" and flops > LONG_FLOPS
        why = _skip_reason(impl, flops, long, pace, budget, opts)
        if why:
            runs[impl] = (why, why, None)
            continue
        runs[impl] = time_impl(impl, shp, args, rows, _short(opts) if long else opts)
        if not any(isinstance(t, str) for t in runs[impl][:2]):
            pace[impl] = (runs[impl][0] + runs[impl][1]) / flops
    del args
    ref = runs["chunked"][2]
    for impl in IMPLS:
        t_fwd, t_all, samples = runs[impl]
        errs = _errors(samples, ref) if impl == "pallas" else None
        cells, figs = _row(impl, t_fwd, t_all, flops, errs, peak)
        print_row([*label, impl, *cells])
        rec = dict(tokens=s, documents=doc, impl=impl, heads=n, kv_heads=kh, head_dim=d)
        results.attention.append(AttnTiming(**rec, fwd_flops=flops, **figs))
    return True
