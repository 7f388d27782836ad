"""The cost model's inputs, as benchmarks/cost_model.py prints them: the bytes per GPU read from
the compiled XLA:GPU programs (benchmarks/scaling.py JSON rows, and how they scale with T where a
second compile exists) and the FLOPs of the XLA:CPU stand-in, turned into compute seconds."""

import json
import sys

from relaymoe_jax.analysis import costmodel as cm

GPUS_PER_HOST = 8


def fmt(x, nd=1):
    return f"{x:,.{nd}f}"


def mib(nbytes):
    return fmt(nbytes / 2**20)


def print_head(head):
    """Prints a Markdown table's header row and its rule."""
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))


def table_row(cells):
    """One Markdown table row of `cells`."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def load_rows(paths):
    """{(ep, top_k, variant, tokens_per_device): row} of every row without an error."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if "error" not in r and "hop_fwd" in r:
                    rows[(r["ep"], r["top_k"], r["variant"], r["tokens_per_device"])] = r
    return rows


def pick(rows, ep, k, variant, tokens):
    """The row of (ep, k, variant) compiled at `tokens`, else at the nearest T; None if none."""
    got = [r for (e, kk, v, _), r in rows.items() if (e, kk, v) == (ep, k, variant)]
    return min(got, key=lambda r: abs(r["tokens_per_device"] - tokens), default=None)


# ---------------------------------------------------------------- bytes


BYTES_HEAD = (
    "EP",
    "hosts",
    "compiled T",
    "P MiB",
    "A MiB",
    "tail MiB",
    "flat shares intra/inter",
    "flat resid fwd",
    "hier resid",
    "a2a intra MiB",
    "a2a inter MiB",
)


def _hier_resid(hc):
    if not hc:
        return "(no row)"
    return (
        f"{hc['fwd_inter']:+.2f} / {hc['fwd_intra']:+.2f}, {hc['bwd_inter']:+.2f} / "
        f"{hc['bwd_intra']:+.2f}"
    )


def _bytes_row(ep, flat, hier, a2a):
    """(the flat ring's bytes `cm.flat_ring_bytes`, the table row of EP `ep`)."""
    b = cm.flat_ring_bytes(flat)
    hc = cm.hier_ring_check(hier, b["payload"], b["acc"], b["tail"]) if hier else None
    cells = [
        ep,
        flat["hosts"],
        f"{flat['tokens_per_device']:,}",
        mib(b["payload"]),
        mib(b["acc"]),
        mib(b["tail"]),
        f"{b['share_intra']:.2f} / {b['share_inter']:.2f}",
        f"{b['fwd_resid'] / b['payload']:+.2f}",
        _hier_resid(hc),
        mib(max(a2a["fwdbwd_a2a_intra"])),
        mib(max(a2a["fwdbwd_a2a_inter"])),
    ]
    return b, table_row(cells)


def bytes_section(args, rows):
    """Prints the bytes table; returns {ep: (flat row, hier row or None, a2a row, flat bytes)}."""
    print("\n### Bytes per GPU from the compiled programs (per transfer; MiB = 2^20 bytes)\n")
    print(
        "P: one payload transfer (the forward loop body's permutes: an expert partition, bf16); "
        "A: the trailing dW accumulator (backward loop body - forward's, f32); tail: the dW's "
        "return after the last hop (compiled backward - its hops); shares: the busiest GPU's "
        "intra-/inter-host part of a hop; resid: compiled total - the schedule, in P (flat "
        "forward; hier fwd inter/intra, bwd inter/intra; -1 at 2 hosts: XLA reuses the "
        "forward's outer transfer); a2a: the busiest GPU's all-to-all bytes in one fwd+bwd "
        "at the compiled T\n"
    )
    print_head(BYTES_HEAD)
    k, model_in = args.top_k, {}
    for ep in args.ep:
        flat, hier, a2a = (
            pick(rows, ep, k, v, args.scaling_tokens)
            for v in ("ring-expert", "hier-expert", "a2a-cap1.0")
        )
        if flat is None or a2a is None:
            sys.exit(
                f"cost_model.py: error: no compiled ring-expert / a2a-cap1.0 row at EP {ep} "
                f"k={k} (benchmarks/scaling.py refused or failed it)"
            )
        b, line = _bytes_row(ep, flat, hier, a2a)
        model_in[ep] = (flat, hier, a2a, b)
        print(line)
    return model_in


def _t_check(rows, ep, k, v):
    """How variant v's bytes at EP ep scale between its largest and smallest compiled T, or None
    with fewer than two."""
    ts = sorted(
        r["tokens_per_device"] for (e, kk, vv, _), r in rows.items() if (e, kk, vv) == (ep, k, v)
    )
    if len(ts) < 2:
        return None
    r0, r1 = (rows[(ep, k, v, t)] for t in (ts[-1], ts[0]))
    if v == "ring-expert":
        b0, b1 = cm.flat_ring_bytes(r0), cm.flat_ring_bytes(r1)
        return (
            f"EP {ep} ring-expert: P, A, tail at T={ts[0]:,} / at "
            f"T={ts[-1]:,}: {b1['payload'] / b0['payload']:.4f}, "
            f"{b1['acc'] / b0['acc']:.4f}, {b1['tail'] / b0['tail']:.4f} "
            "(the model: 1, expert routing's bytes do not depend on T)"
        )
    pred = cm.alltoall_bytes(r0, ts[0])
    got = (max(r1["fwdbwd_a2a_intra"]), max(r1["fwdbwd_a2a_inter"]))
    return (
        f"EP {ep} a2a-cap1.0: bytes compiled at T={ts[0]:,} / scaled from "
        f"T={ts[-1]:,}: intra {got[0] / pred[0]:.4f}, inter "
        f"{got[1] / pred[1]:.4f} (the model: 1, proportional to T)"
    )


def t_checks_section(args, rows):
    """Prints the T-dependence of the bytes, where a second compile exists."""
    checks = [
        c
        for ep in args.ep
        for v in ("ring-expert", "a2a-cap1.0")
        if (c := _t_check(rows, ep, args.top_k, v)) is not None
    ]
    if checks:
        print(
            "\nT-dependence, checked against a second compile:\n"
            + "\n".join(f"- {c}" for c in checks)
        )


# ---------------------------------------------------------------- FLOPs


FLOPS_HEAD = (
    "EP",
    "T/dev",
    "pairs per expert per hop",
    "hop fwd GFLOP",
    "hop fwd+bwd GFLOP",
    "a2a fwd+bwd GFLOP",
    "units/pair: fwd, vjp, a2a bwd",
)


def compute_seconds(rates, hop, full, pairs, ep, hidden, ffn):
    """(ring hop fwd, ring hop bwd, a2a fwd+bwd, a2a fwd+bwd with the forward recomputed) compute
    seconds: `hop` / `full` the stand-in FLOPs of one hop's `pairs` pairs / of the device's
    ep * pairs (used where a rate is assumed)."""
    fwd = lambda fl, n: rates.forward_s(fl["fwd"], n, hidden, ffn)
    bwd = lambda fl, key, n, again: rates.backward_s(fl[key], n, hidden, ffn, recompute=again)
    n_all = ep * pairs
    return (
        fwd(hop, pairs),
        bwd(hop, "vjp", pairs, True),
        fwd(full, n_all) + bwd(full, "bwd", n_all, False),
        fwd(full, n_all) + bwd(full, "vjp", n_all, True),
    )


def flops_section(args, shape, rates):
    """Prints the stand-in's FLOPs per (EP, T); returns {(ep, T): `compute_seconds`}."""
    experts, hidden, ffn = shape
    k = args.top_k
    print("\n### FLOPs from the stand-in (XLA:CPU cost_analysis, per GPU)\n")
    print(
        "ring hop: E/EP experts x T*k/E pairs each; fwd+bwd = fwd + the VJP program (recompute "
        "+ gradients); a2a: E/EP experts x EP*T*k/E pairs, fwd + backward from residuals; "
        "units: 2*H*F FLOPs per pair (a check, not used)\n"
    )
    print_head(FLOPS_HEAD)
    secs = {}
    for ep in args.ep:
        el = experts // ep
        for t in args.tokens:
            n = cm.pairs_per_expert(t, k, experts)
            hop = cm.standin_flops(el, n, hidden, ffn)
            full = cm.standin_flops(el, ep * n, hidden, ffn)
            secs[ep, t] = compute_seconds(rates, hop, full, el * n, ep, hidden, ffn)
            unit = 2 * hidden * ffn * el * n
            print(
                f"| {ep} | {t:,} | {n:,} | {fmt(hop['fwd'] / 1e9)} | "
                f"{fmt((hop['fwd'] + hop['vjp']) / 1e9)} | "
                f"{fmt((full['fwd'] + full['bwd']) / 1e9)} | "
                f"{hop['fwd'] / unit:.3f}, {hop['vjp'] / unit:.3f}, "
                f"{full['bwd'] / (unit * ep):.3f} |",
                flush=True,
            )
    return secs
