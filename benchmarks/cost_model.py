"""A cost model on paper (not a measurement): per-layer ms, forward + backward, of the all-to-all
(capacity 1.0), the flat ring and the hierarchical ring at EP = 8 to 64 on H100 hosts of 8 GPUs.

Bytes come from the compiled XLA:GPU programs (`benchmarks/scaling.py --json`: per-device
collective-permute and all-to-all bytes by link class, one ring hop's bytes); FLOPs from XLA:CPU's
`cost_analysis()` of a stand-in that does one hop's work under balanced routing; time from two
assumed constants (NVLink and NIC bandwidth per direction), the compute rates (measured on a GPU
where `benchmarks/gpu.py --json` wrote them, else assumed: bf16 throughput) and the rules of
`relaymoe_jax.costmodel` (its docstring has the formulas and the constants' sources). Expert
routing (what routing="auto" picks at the paper shape). The output starts by saying which
compute figures are measured and which assumed.

    python benchmarks/cost_model.py [--scaling-json benchmarks/results/scaling.json ...] \
        [--check-tokens 15360] [--tokens 4096 ... 131072] [--tflops 346.3] [--nvlink-gbs 450] \
        [--nic-gbs 50] [--measurements benchmarks/results/gpu.json | none] \
        [--out docs/img/cost_model.png]

Without --scaling-json (or when a needed row is missing) it runs `benchmarks/scaling.py` for the
missing (EP, variant) rows first (XLA:GPU compiles, minutes at EP=64), into --scaling-out;
--check-tokens T also compiles the flat ring and the all-to-all at a second T, to check the
model's rule for T (expert routing's bytes constant, the all-to-all's proportional).
"""

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from relaymoe_jax import costmodel as cm
from relaymoe_jax.argtypes import positive_float, positive_int

VARIANTS = ("ring-expert", "hier-expert", "a2a-cap1.0")
GPUS_PER_HOST = 8
DEFAULT_TOKENS = [4096, 8192, 16384, 32768, 61440, 98304, 131072]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--scaling-json",
        nargs="+",
        default=[],
        metavar="PATH",
        help="benchmarks/scaling.py --json outputs (rows merged; later files win)",
    )
    p.add_argument(
        "--scaling-out",
        default="/tmp/cost_model_scaling.json",
        metavar="PATH",
        help="where to write the rows this command compiles itself, if any",
    )
    p.add_argument("--ep", type=positive_int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--top-k", "-k", type=positive_int, default=8)
    p.add_argument(
        "--scaling-tokens",
        type=positive_int,
        default=61440,
        help="tokens per device of the compiled rows the model reads (default "
        "61440, the paper shape; rows missing at it are compiled)",
    )
    p.add_argument(
        "--check-tokens",
        type=positive_int,
        metavar="T",
        help="also compile the flat ring and the all-to-all at this second T (at "
        "--check-ep) to check how their bytes scale with T",
    )
    p.add_argument("--check-ep", type=positive_int, default=16, help="default %(default)s")
    p.add_argument(
        "--tokens",
        type=positive_int,
        nargs="+",
        default=DEFAULT_TOKENS,
        help="tokens per device to predict (default %(default)s)",
    )
    p.add_argument(
        "--tflops",
        type=positive_float,
        default=cm.DEFAULT_TFLOPS,
        help=f"assumed bf16 matmul throughput per GPU where not measured, TFLOP/s "
        f"(default {cm.DEFAULT_TFLOPS} = {cm.EFFICIENCY} x the H100 SXM dense "
        f"peak {cm.H100_BF16_TFLOPS})",
    )
    p.add_argument(
        "--measurements",
        metavar="PATH",
        default=None,
        help="benchmarks/gpu.py --json output with measured compute rates (default: "
        f"{cm.MEASUREMENTS.relative_to(cm.REPO)} if it exists); 'none': assume",
    )
    p.add_argument(
        "--nvlink-gbs",
        type=positive_float,
        default=cm.NVLINK_GBS,
        help="NVLink GB/s per direction per GPU (default %(default)s, H100 NVLink 4)",
    )
    p.add_argument(
        "--nic-gbs",
        type=positive_float,
        default=cm.NIC_GBS,
        help="network GB/s per direction per GPU (default %(default)s, IB NDR 400 Gb/s)",
    )
    p.add_argument("--out", default="docs/img/cost_model.png", help="plot path (PNG)")
    a = p.parse_args(argv)
    for ep in [*a.ep, a.check_ep]:
        if ep > GPUS_PER_HOST and ep % GPUS_PER_HOST:
            p.error(f"--ep {ep}: more than {GPUS_PER_HOST} GPUs must fill whole hosts")
    for path in a.scaling_json:
        if not os.path.isfile(path):
            p.error(f"--scaling-json {path}: no such file")
    if a.measurements not in (None, "none") and not os.path.isfile(a.measurements):
        p.error(f"--measurements {a.measurements}: no such file")
    return a


def compute_rates(args, hidden, ffn) -> cm.ComputeRates:
    """The forward and backward compute rates: measured (--measurements) or assumed (--tflops)."""
    if args.measurements == "none":
        return cm.ComputeRates(cm.assumed_rate(args.tflops), cm.assumed_rate(args.tflops))
    try:
        return cm.load_rates(args.measurements, assumed_tflops=args.tflops, hidden=hidden, ffn=ffn)
    except cm.MeasurementError as e:
        sys.exit(f"cost_model.py: error: --measurements: {e}")


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


def compile_missing(args, rows, shape):
    """Run benchmarks/scaling.py for the (EP, variant, T) rows we lack (its table goes to
    stderr): every variant at --scaling-tokens, and with --check-tokens the flat ring and the
    all-to-all at --check-ep at that second T."""
    k = args.top_k
    need = [(v, ep, args.scaling_tokens) for ep in args.ep for v in VARIANTS]
    if args.check_tokens:
        need += [(v, args.check_ep, args.check_tokens) for v in ("ring-expert", "a2a-cap1.0")]
    missing = {}  # T -> ({EP}, {variant})
    for v, ep, t in need:
        if (ep, k, v, t) not in rows:
            eps, vs = missing.setdefault(t, (set(), set()))
            eps.add(ep)
            vs.add(v)
    if not missing:
        return rows
    import importlib.util

    spec = importlib.util.spec_from_file_location("scaling", Path(__file__).with_name("scaling.py"))
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    experts, hidden, ffn = shape
    for t, (eps, vs) in sorted(missing.items()):
        out = (
            args.scaling_out
            if t == args.scaling_tokens
            else str(Path(args.scaling_out).with_suffix("")) + f"_T{t}.json"
        )
        print(
            f"# compiling with benchmarks/scaling.py (rows not given): EP {sorted(eps)}, "
            f"T={t:,}, {sorted(vs)} -> {out}",
            flush=True,
        )
        with contextlib.redirect_stdout(sys.stderr):
            scaling.main(
                [
                    "--ep",
                    *map(str, sorted(eps)),
                    "-k",
                    str(k),
                    "-E",
                    str(experts),
                    "-H",
                    str(hidden),
                    "-F",
                    str(ffn),
                    "-T",
                    str(t),
                    "--variants",
                    *sorted(vs),
                    "--json",
                    out,
                ]
            )
        rows = {**load_rows([out]), **rows}
    return rows


def fmt(x, nd=1):
    return f"{x:,.{nd}f}"


def main(argv=None):
    args = parse_args(argv)
    cmd = " ".join(
        shlex.quote(a)
        for a in ["python", "benchmarks/cost_model.py", *(sys.argv[1:] if argv is None else argv)]
    )
    print(f"# reproduce: {cmd}", flush=True)
    rows = load_rows(args.scaling_json)
    any_row = next(iter(rows.values()), None)
    shape = (any_row["experts"], any_row["hidden"], any_row["ffn"]) if any_row else (128, 2048, 768)
    rows = compile_missing(args, rows, shape)
    experts, hidden, ffn = shape
    k = args.top_k
    links = cm.Links(args.nvlink_gbs * 1e9, args.nic_gbs * 1e9)
    rates = compute_rates(args, hidden, ffn)
    mib = lambda b: fmt(b / 2**20)

    measured = [r for r in (rates.fwd, rates.bwd) if r.measured]
    print(
        "# A MODEL ON PAPER, NOT A MEASUREMENT: "
        + (
            "nothing here ran on a network; its compute rates were measured on one GPU (below)."
            if measured
            else "nothing here ran on a GPU or a network."
        )
    )
    print("".join(f"# {line}\n" for line in rates.report()), end="")
    print(
        f"# shape: E={experts} k={k} H={hidden} F={ffn} bf16, expert routing, hosts of "
        f"{GPUS_PER_HOST} H100; assumed: NVLink {fmt(args.nvlink_gbs, 0)} GB/s and NIC "
        f"{fmt(args.nic_gbs, 0)} GB/s per direction per GPU; compute: "
        + (
            "measured rates on the GPU run's FLOP count (6 and 12 x pairs x H x F, "
            "relaymoe_jax.costmodel.hop_flops), "
            if measured
            else ""
        )
        + ("assumed rates on the stand-in's FLOPs" if len(measured) < 2 else "").rstrip(", ")
    )
    print(
        "# bytes: compiled XLA:GPU programs (benchmarks/scaling.py JSON); FLOPs: XLA:CPU "
        "cost_analysis of the stand-in; rules: relaymoe_jax/costmodel.py",
        flush=True,
    )

    # ---- bytes, from the compiled programs
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
    head = (
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
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    model_in = {}
    for ep in args.ep:
        flat = pick(rows, ep, k, "ring-expert", args.scaling_tokens)
        hier = pick(rows, ep, k, "hier-expert", args.scaling_tokens)
        a2a = pick(rows, ep, k, "a2a-cap1.0", args.scaling_tokens)
        if flat is None or a2a is None:
            sys.exit(
                f"cost_model.py: error: no compiled ring-expert / a2a-cap1.0 row at EP {ep} "
                f"k={k} (benchmarks/scaling.py refused or failed it)"
            )
        b = cm.flat_ring_bytes(flat)
        hc = cm.hier_ring_check(hier, b["payload"], b["acc"], b["tail"]) if hier else None
        model_in[ep] = (flat, hier, a2a, b)
        print(
            "| "
            + " | ".join(
                str(c)
                for c in [
                    ep,
                    flat["hosts"],
                    f"{flat['tokens_per_device']:,}",
                    mib(b["payload"]),
                    mib(b["acc"]),
                    mib(b["tail"]),
                    f"{b['share_intra']:.2f} / {b['share_inter']:.2f}",
                    f"{b['fwd_resid'] / b['payload']:+.2f}",
                    (
                        f"{hc['fwd_inter']:+.2f} / {hc['fwd_intra']:+.2f}, {hc['bwd_inter']:+.2f} / "
                        f"{hc['bwd_intra']:+.2f}"
                    )
                    if hc
                    else "(no row)",
                    mib(max(a2a["fwdbwd_a2a_intra"])),
                    mib(max(a2a["fwdbwd_a2a_inter"])),
                ]
            )
            + " |"
        )
    # T-dependence, where a second compile exists
    checks = []
    for ep in args.ep:
        for v in ("ring-expert", "a2a-cap1.0"):
            ts = sorted(
                r["tokens_per_device"]
                for (e, kk, vv, _), r in rows.items()
                if (e, kk, vv) == (ep, k, v)
            )
            if len(ts) < 2:
                continue
            r0, r1 = (rows[(ep, k, v, t)] for t in (ts[-1], ts[0]))
            if v == "ring-expert":
                b0, b1 = cm.flat_ring_bytes(r0), cm.flat_ring_bytes(r1)
                checks.append(
                    f"EP {ep} ring-expert: P, A, tail at T={ts[0]:,} / at "
                    f"T={ts[-1]:,}: {b1['payload'] / b0['payload']:.4f}, "
                    f"{b1['acc'] / b0['acc']:.4f}, {b1['tail'] / b0['tail']:.4f} "
                    "(the model: 1, expert routing's bytes do not depend on T)"
                )
            else:
                pred = cm.alltoall_bytes(r0, ts[0])
                got = (max(r1["fwdbwd_a2a_intra"]), max(r1["fwdbwd_a2a_inter"]))
                checks.append(
                    f"EP {ep} a2a-cap1.0: bytes compiled at T={ts[0]:,} / scaled from "
                    f"T={ts[-1]:,}: intra {got[0] / pred[0]:.4f}, inter "
                    f"{got[1] / pred[1]:.4f} (the model: 1, proportional to T)"
                )
    if checks:
        print(
            "\nT-dependence, checked against a second compile:\n"
            + "\n".join(f"- {c}" for c in checks)
        )

    # ---- FLOPs, from the stand-in
    print("\n### FLOPs from the stand-in (XLA:CPU cost_analysis, per GPU)\n")
    print(
        "ring hop: E/EP experts x T*k/E pairs each; fwd+bwd = fwd + the VJP program (recompute "
        "+ gradients); a2a: E/EP experts x EP*T*k/E pairs, fwd + backward from residuals; "
        "units: 2*H*F FLOPs per pair (a check, not used)\n"
    )
    head = (
        "EP",
        "T/dev",
        "pairs per expert per hop",
        "hop fwd GFLOP",
        "hop fwd+bwd GFLOP",
        "a2a fwd+bwd GFLOP",
        "units/pair: fwd, vjp, a2a bwd",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
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

    # ---- the prediction
    print("\n### Predicted ms per layer (forward + backward), per GPU\n")
    print(
        "ring compute: EP hops of (fwd + fwd+bwd) compute, no transfer; flat / hier bound: "
        "what the slowest loop hop (flat) or round (hier) waits for, fwd / bwd: compute, "
        "NIC or NVLink\n"
    )
    head = (
        "EP",
        "hosts",
        "T/dev",
        "ring compute ms",
        "a2a-cap1.0 ms",
        "flat ring ms",
        "hier ring ms",
        "a2a / flat",
        "a2a / hier",
        "flat bound fwd/bwd",
        "hier bound fwd/bwd",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    pred = {}
    for ep in args.ep:
        flat, hier, a2a, b = model_in[ep]
        hosts, local = max(1, ep // GPUS_PER_HOST), min(ep, GPUS_PER_HOST)
        p, a = b["payload"], b["acc"]
        fl = cm.flat_levels(ep, b["share_intra"], b["share_inter"])
        hl = cm.hier_levels(hosts, local)
        for t in args.tokens:
            c_f, c_b, c_a2a, c_a2a_remat = secs[ep, t]
            r_flat = cm.ring_layer_time(fl, c_f, c_b, p, a, links, b["tail"])
            r_hier = cm.ring_layer_time(hl, c_f, c_b, p, a, links, b["tail"])
            r_a2a = cm.alltoall_time_s(c_a2a, *cm.alltoall_bytes(a2a, t), links)
            compute = ep * (c_f + c_b)

            def what(level, c, nbytes, hops=1):
                t_ = cm.transfer_time(nbytes, level, links)
                if not cm.bound(hops * c, t_):
                    return "compute"
                return "NIC" if level.inter * links.nvlink > level.intra * links.nic else "NVLink"

            flat_b = f"{what(fl[0], c_f, p)} / {what(fl[0], c_b, p + a)}"
            inner = hl[-1]
            hb = []
            for c, nb in ((c_f, p), (c_b, p + a)):
                w_in = what(inner, c, nb)
                w_out = what(hl[0], c, nb, hops=inner.n) if len(hl) > 1 else "compute"
                hb.append(w_out if w_out != "compute" else w_in)
            r_remat = cm.alltoall_time_s(c_a2a_remat, *cm.alltoall_bytes(a2a, t), links)
            pred[ep, t] = dict(
                a2a=r_a2a["total"],
                flat=r_flat["total"],
                hier=r_hier["total"],
                compute=compute,
                a2a_remat=r_remat["total"],
                a2a_comm=r_a2a["comm"],
            )
            print(
                "| "
                + " | ".join(
                    str(c)
                    for c in [
                        ep,
                        hosts,
                        f"{t:,}",
                        fmt(compute * 1e3),
                        fmt(r_a2a["total"] * 1e3),
                        fmt(r_flat["total"] * 1e3),
                        fmt(r_hier["total"] * 1e3),
                        f"{r_a2a['total'] / r_flat['total']:.2f}",
                        f"{r_a2a['total'] / r_hier['total']:.2f}",
                        flat_b,
                        " / ".join(hb),
                    ]
                )
                + " |",
                flush=True,
            )

    # ---- the lines: where a hop's compute equals its transfer
    print("\n### Where the ring stops hiding its transfers (tokens per device)\n")
    print(
        "A hop's compute grows with T, expert routing's transfer does not: below the line the "
        "hop waits for its transfer. flat: one hop's compute = one hop's transfer over its "
        "slowest link (NIC beyond one host); hier: a round's L hops of compute = the round's "
        "NIC transfer (the NIC line / L), and one hop's compute = its NVLink transfer (the "
        "NVLink line, the floor); each the larger of fwd and bwd\n"
    )
    head = (
        "EP",
        "hosts",
        "flat line fwd / bwd",
        "flat line",
        "hier NIC line / L fwd / bwd",
        "NVLink line fwd / bwd",
        "hier line",
        "flat / hier",
    )
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    lines = {}
    t_ref = max(args.tokens)
    for ep in args.ep:
        flat, hier, a2a, b = model_in[ep]
        hosts, local = max(1, ep // GPUS_PER_HOST), min(ep, GPUS_PER_HOST)
        p, a = b["payload"], b["acc"]
        fl = cm.flat_levels(ep, b["share_intra"], b["share_inter"])[0]
        outer, inner = cm.Level(hosts, 0.0, 1.0), cm.Level(local, 1.0, 0.0)
        per_tok = tuple(c / t_ref for c in secs[ep, t_ref][:2])  # compute s per token
        th = lambda level, nb, st, hops=1: cm.threshold_tokens(
            cm.transfer_time(nb, level, links), hops * st, 1.0
        )
        flat_l = [th(fl, nb, ft) for nb, ft in zip((p, p + a), per_tok)]
        nvl_l = [th(inner, nb, ft) for nb, ft in zip((p, p + a), per_tok)]
        out_l = (
            [th(outer, nb, ft, inner.n) for nb, ft in zip((p, p + a), per_tok)]
            if hosts > 1
            else [0.0, 0.0]
        )
        hier_line = max(max(out_l), max(nvl_l))
        lines[ep] = dict(flat=max(flat_l), hier=hier_line, nvlink=max(nvl_l), hosts=hosts)
        sl = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
        print(
            "| "
            + " | ".join(
                str(c)
                for c in [
                    ep,
                    hosts,
                    sl(flat_l),
                    f"{max(flat_l):,.0f}",
                    sl(out_l) if hosts > 1 else "- (one host)",
                    sl(nvl_l),
                    f"{hier_line:,.0f}",
                    f"{max(flat_l) / hier_line:.2f}" if hosts > 1 else "-",
                ]
            )
            + " |"
        )

    # ---- the two statements
    print("\n### What the model says\n")
    t_paper = args.scaling_tokens
    if 8 in args.ep and t_paper in args.tokens:
        r = pred[8, t_paper]
        print(
            f"- One host, EP=8, T={t_paper:,} per GPU: flat ring {r['flat'] * 1e3:,.1f} ms, "
            f"all-to-all {r['a2a'] * 1e3:,.1f} ms per layer (a2a / ring "
            f"{r['a2a'] / r['flat']:.2f}x); the ring's hops are compute-bound above "
            f"T = {lines[8]['flat']:,.0f} (NVLink line), so it costs its compute "
            f"({r['compute'] * 1e3:,.1f} ms) and the all-to-all pays its exchange "
            f"({r['a2a_comm'] * 1e3:,.1f} ms) on top of less compute (no recompute). Were the "
            f"all-to-all's forward recomputed in its backward as the ring's is (its FLOPs only, "
            f"its all-to-alls not repeated): {r['a2a_remat'] * 1e3:,.1f} ms, a2a / ring "
            f"{r['a2a_remat'] / r['flat']:.2f}x."
        )
    multi = [ep for ep in args.ep if lines[ep]["hosts"] > 1]
    if multi:
        fl_ = [lines[ep]["flat"] for ep in multi]
        hl_ = [lines[ep]["hier"] for ep in multi]
        nv_ = [lines[ep]["nvlink"] for ep in multi]
        span = lambda xs, f: (
            f(min(xs)) if f(min(xs)) == f(max(xs)) else f"{f(min(xs))}-{f(max(xs))}"
        )
        tok = lambda x: f"{x:,.0f}"
        moved = [f / h for f, h in zip(fl_, hl_)]
        hosts_ = [ep // GPUS_PER_HOST for ep in multi]
        print(
            f"- Over {span(hosts_, str)} hosts (EP {', '.join(map(str, multi))}): the flat "
            f"ring is network-bound below T = {span(fl_, tok)} tokens per GPU (a hop's NIC "
            f"transfer outlasts its compute); the hierarchical ring moves that line to T = "
            f"{span(hl_, tok)}, {span(moved, lambda x: f'{x:.2f}')}x fewer tokens (L = "
            f"{GPUS_PER_HOST}; its floor, the NVLink line, is T = {span(nv_, tok)})."
        )
    for t in sorted({t_paper, 98304} & set(args.tokens)):
        print(
            f"- By EP at T={t:,} per GPU: a2a / flat ring "
            + ", ".join(
                f"{pred[ep, t]['a2a'] / pred[ep, t]['flat']:.2f}x (EP {ep})" for ep in args.ep
            )
            + "; a2a / hierarchical ring "
            + ", ".join(
                f"{pred[ep, t]['a2a'] / pred[ep, t]['hier']:.2f}x (EP {ep})" for ep in args.ep
            )
            + "."
        )
    print(
        f"- Both lines scale with the compute rates (here {rates_text(rates)}) and inversely "
        f"with the link's bandwidth."
    )

    out = plot(args, rates, pred, lines, Path(args.out))
    print(f"\n# plot: {out}")


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


def rates_text(rates) -> str:
    """The compute rates in a few words, e.g. 'fwd 312.5 / bwd 288.1 TFLOP/s, measured'."""
    kind = lambda r: "measured" if r.measured else "assumed"
    same = kind(rates.fwd) == kind(rates.bwd)
    return f"fwd {rates.fwd.tflops:.4g} / bwd {rates.bwd.tflops:.4g} TFLOP/s, " + (
        kind(rates.fwd) if same else f"{kind(rates.fwd)} / {kind(rates.bwd)}"
    )


def plot(args, rates, pred, lines, out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    eps = args.ep
    fig = Figure(figsize=(3.6 * len(eps), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(eps), squeeze=False, sharey=True)[0]
    ts = sorted(args.tokens)
    for ax, ep in zip(axes, eps):
        for key, label, style in (
            ("a2a", "all-to-all (cap 1.0)", "-o"),
            ("flat", "flat ring", "-s"),
            ("hier", "hierarchical ring", "-^"),
            ("compute", "ring compute only", ":"),
        ):
            ax.plot(ts, [pred[ep, t][key] * 1e3 for t in ts], style, label=label, ms=4)
        ln = lines[ep]
        ax.axvline(ln["flat"], color="C1", ls="--", lw=0.8)  # one host: the NVLink line
        if ln["hosts"] > 1:
            ax.axvline(ln["hier"], color="C2", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"EP={ep} ({ln['hosts']} host{'s' if ln['hosts'] > 1 else ''} x 8)")
        ax.set_xlabel("tokens per GPU")
    axes[0].set_ylabel("predicted ms per layer (fwd+bwd)")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"A cost model, not a measurement: NVLink {args.nvlink_gbs:g} GB/s, NIC "
        f"{args.nic_gbs:g} GB/s per direction, compute {rates_text(rates)}\n"
        "dashed: where the flat (orange) / hierarchical (green) ring stops hiding its "
        "transfers",
        fontsize=9,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    main()
