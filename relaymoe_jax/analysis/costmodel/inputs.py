"""The cost model's inputs from compiled programs: the bytes each GPU sends and one hop's FLOPs.

Bytes: from one JSON row of `benchmarks/scaling.py` (compiled XLA:GPU programs): a ring's P, A,
tail and link shares (`flat_ring_bytes`), the hierarchical ring's check against its schedule
(`hier_ring_check`), the all-to-all's bytes (`alltoall_bytes`). FLOPs: XLA:CPU `cost_analysis()`
of a stand-in doing one hop's work (`standin_flops`).
"""

from relaymoe_jax.analysis.costmodel.rules import relay_sends


def fp8_payload(bf16_bytes: int, hidden: int, ffn: int, block: int = 128) -> int:
    """Bytes of an expert partition relayed as e4m3 (`expert_fp8`): one byte per weight and one
    float32 scale per block x block tile of each [H, F] (or [F, H]) matrix, for the same
    partition's `bf16_bytes` (tests/test_gpu_compile.py checks it against the compiled relay)."""
    weights = bf16_bytes // 2
    tiles = -(-hidden // block) * -(-ffn // block)
    return weights + 4 * tiles * weights // (hidden * ffn)


def _per_device(row, prog, kind="permute"):
    intra, inter = row[f"{prog}_{kind}_intra"], row[f"{prog}_{kind}_inter"]
    return list(intra), list(inter), [a + b for a, b in zip(intra, inter)]


def flat_ring_bytes(row) -> dict:
    """P, A, the tail and the link shares of a flat ring from one compiled row of
    `benchmarks/scaling.py` (JSON). P = hop_fwd, A = hop_bwd - hop_fwd (the loop bodies); the
    tail = the compiled backward's bytes (fwd+bwd program minus forward, per GPU) minus the hops
    of `relay_sends` (P, then EP-2 x (P + A), then A): what the compiled program sends after the
    last hop. It comes out as P, not A: XLA converts the finished dW to the weights' bf16 before
    its last permute. fwd_resid = compiled forward bytes - (EP-1) P (0 expected)."""
    n = row["ep"]
    p, a = row["hop_fwd"], row["hop_bwd"] - row["hop_fwd"]
    ft = _per_device(row, "fwd")[2]
    bi, be, bt = _per_device(row, "fwdbwd")
    tot = max(bt)
    bwd_total = max(x - y for x, y in zip(bt, ft))
    sends, _ = relay_sends(n, p, a)
    return {
        "payload": p,
        "acc": a,
        "tail": bwd_total - sum(sends),
        "share_intra": max(bi) / tot if tot else 0.0,
        "share_inter": max(be) / tot if tot else 0.0,
        "fwd_resid": max(ft) - (n - 1) * p,
    }


def hier_ring_check(row, payload: float, acc: float, tail: float) -> dict:
    """The compiled hierarchical ring's per-device bytes by class against the nested schedule
    (the flat ring's P, A and tail; each round's inner ring returns an f32 partial, A, except
    on one host, where the one round is the flat ring and ends with its tail):
    (compiled - schedule) / P, per pass and class. 0 expected; -1 for the backward's inter-host
    bytes at 2 hosts, where XLA reuses the forward's one outer transfer (both are peeled out of
    a one-trip loop) for the backward's first."""
    m, local = row["hosts"], row["gpus_per_host"]
    fi, fe, _ = _per_device(row, "fwd")
    bi, be, _ = _per_device(row, "fwdbwd")
    out_f, _ = relay_sends(m, payload)
    in_f, _ = relay_sends(local, payload)
    out_b, out_tail = relay_sends(m, payload, acc, tail)
    # a round returns its f32 partial; on one host the round is the whole (flat) ring
    in_b, in_tail = relay_sends(local, payload, acc, tail if m == 1 else None)
    expect = {
        "fwd_inter": sum(out_f),
        "fwd_intra": m * sum(in_f),
        "bwd_inter": sum(out_b) + out_tail,
        "bwd_intra": m * (sum(in_b) + in_tail),
    }
    got = {
        "fwd_inter": max(fe),
        "fwd_intra": max(fi),
        "bwd_inter": max(x - y for x, y in zip(be, fe)),
        "bwd_intra": max(x - y for x, y in zip(bi, fi)),
    }
    return {k: (got[k] - expect[k]) / payload for k in expect}


def alltoall_bytes(row, tokens: int) -> tuple[float, float]:
    """(intra, inter) all-to-all bytes of the busiest GPU in one fwd+bwd at `tokens` per device:
    the compiled row's, scaled in proportion to tokens (capacity 1.0 buffers hold T*k/E rows per
    expert, up to rounding; checked against a second compile where one is given)."""
    scale = tokens / row["tokens_per_device"]
    return (max(row["fwdbwd_a2a_intra"]) * scale, max(row["fwdbwd_a2a_inter"]) * scale)


def pairs_per_expert(tokens: int, top_k: int, experts: int) -> int:
    """Balanced routing: each expert sees T*k/E of one device's pairs (rounded up)."""
    return -(-tokens * top_k // experts)


def standin_flops(e_local: int, pairs: int, hidden: int, ffn: int, dtype="bfloat16") -> dict:
    """XLA:CPU `cost_analysis()["flops"]` of a batched SwiGLU over `e_local` experts of `pairs`
    rows each (compiled from abstract shapes, never run): "fwd" the forward with router weights;
    "vjp" the program that recomputes the forward and computes every gradient from the inputs
    (the ring's backward hop); "bwd" the gradients from the forward's saved residuals (autodiff,
    the all-to-all's backward)."""
    return _standin_flops(e_local, pairs, hidden, ffn, str(dtype))


_CACHE: dict = {}


def _standin_flops(e_local, pairs, hidden, ffn, dtype):
    key = (e_local, pairs, hidden, ffn, dtype)
    if key in _CACHE:
        return _CACHE[key]
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32

    def swiglu(x, wg, wu, wd, wts):
        gate = jnp.einsum("enh,ehf->enf", x, wg, preferred_element_type=f32)
        up = jnp.einsum("enh,ehf->enf", x, wu, preferred_element_type=f32)
        act = (jax.nn.silu(gate) * up).astype(x.dtype)
        y = jnp.einsum("enf,efh->enh", act, wd, preferred_element_type=f32)
        return y * wts[..., None].astype(f32)

    def fwd_bwd(x, wg, wu, wd, wts, dy):
        return jax.vjp(swiglu, x, wg, wu, wd, wts)[1](dy)

    sds, dt = jax.ShapeDtypeStruct, jnp.dtype(dtype)
    e, n, h, f = e_local, pairs, hidden, ffn
    args = (
        sds((e, n, h), dt),
        sds((e, h, f), dt),
        sds((e, h, f), dt),
        sds((e, f, h), dt),
        sds((e, n), dt),
    )
    dy = sds((e, n, h), f32)
    cpu = jax.devices("cpu")[0]

    def flops(fn, *a):
        with jax.default_device(cpu):
            cost = jax.jit(fn).lower(*a).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])

    residuals = jax.eval_shape(lambda *a: jax.vjp(swiglu, *a)[1], *args)
    out = {
        "fwd": flops(swiglu, *args),
        "vjp": flops(fwd_bwd, *args, dy),
        "bwd": flops(lambda vjp_fn, dy: vjp_fn(dy), residuals, dy),
    }
    _CACHE[key] = out
    return out
