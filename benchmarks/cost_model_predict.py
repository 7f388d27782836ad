"""The cost model's outputs, as benchmarks/cost_model.py prints them: the predicted ms per layer
of the all-to-all and the flat and hierarchical rings, the token counts below which a ring hop
waits for its transfer (the lines), what the model says in words, and the plot."""

from pathlib import Path

from cost_model_inputs import GPUS_PER_HOST, fmt, print_head, table_row

from relaymoe_jax.analysis import costmodel as cm

# ---------------------------------------------------------------- predicted ms


PREDICT_HEAD = (
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


def bound_by(level, c, nbytes, links, hops=1):
    """What `hops` hops of `c` compute seconds each wait for at `level`: compute, NIC or NVLink."""
    t_ = cm.transfer_time(nbytes, level, links)
    if not cm.bound(hops * c, t_):
        return "compute"
    return "NIC" if level.inter * links.nvlink > level.intra * links.nic else "NVLink"


def _hier_bounds(hl, c_f, c_b, p, a, links):
    """The hierarchical ring's bound, forward and backward: the outer round's, else a hop's."""
    inner = hl[-1]
    hb = []
    for c, nb in ((c_f, p), (c_b, p + a)):
        w_in = bound_by(inner, c, nb, links)
        w_out = bound_by(hl[0], c, nb, links, hops=inner.n) if len(hl) > 1 else "compute"
        hb.append(w_out if w_out != "compute" else w_in)
    return hb


def _predict(ep, t, model_in, secs, links):
    """({a2a, flat, hier, compute, a2a_remat, a2a_comm} seconds, the table row) at (ep, t)."""
    _, _, a2a, b = model_in[ep]
    hosts, local = max(1, ep // GPUS_PER_HOST), min(ep, GPUS_PER_HOST)
    p, a = b["payload"], b["acc"]
    fl = cm.flat_levels(ep, b["share_intra"], b["share_inter"])
    hl = cm.hier_levels(hosts, local)
    c_f, c_b, c_a2a, c_a2a_remat = secs[ep, t]
    r_flat = cm.ring_layer_time(fl, c_f, c_b, p, a, links, b["tail"])
    r_hier = cm.ring_layer_time(hl, c_f, c_b, p, a, links, b["tail"])
    r_a2a = cm.alltoall_time_s(c_a2a, *cm.alltoall_bytes(a2a, t), links)
    compute = ep * (c_f + c_b)
    flat_b = f"{bound_by(fl[0], c_f, p, links)} / {bound_by(fl[0], c_b, p + a, links)}"
    hb = _hier_bounds(hl, c_f, c_b, p, a, links)
    r_remat = cm.alltoall_time_s(c_a2a_remat, *cm.alltoall_bytes(a2a, t), links)
    pred = dict(
        a2a=r_a2a["total"],
        flat=r_flat["total"],
        hier=r_hier["total"],
        compute=compute,
        a2a_remat=r_remat["total"],
        a2a_comm=r_a2a["comm"],
    )
    cells = [
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
    return pred, table_row(cells)


def prediction_section(args, model_in, secs, links):
    """Prints the predicted ms per layer; returns {(ep, T): `_predict`'s seconds}."""
    print("\n### Predicted ms per layer (forward + backward), per GPU\n")
    print(
        "ring compute: EP hops of (fwd + fwd+bwd) compute, no transfer; flat / hier bound: "
        "what the slowest loop hop (flat) or round (hier) waits for, fwd / bwd: compute, "
        "NIC or NVLink\n"
    )
    print_head(PREDICT_HEAD)
    pred = {}
    for ep in args.ep:
        for t in args.tokens:
            pred[ep, t], line = _predict(ep, t, model_in, secs, links)
            print(line, flush=True)
    return pred


# ---------------------------------------------------------------- the lines


LINES_HEAD = (
    "EP",
    "hosts",
    "flat line fwd / bwd",
    "flat line",
    "hier NIC line / L fwd / bwd",
    "NVLink line fwd / bwd",
    "hier line",
    "flat / hier",
)


def _lines(ep, b, per_tok, links):
    """({flat, hier, nvlink, hosts}, the table row) of EP ep: per_tok the (fwd, bwd) compute
    seconds per token."""
    hosts, local = max(1, ep // GPUS_PER_HOST), min(ep, GPUS_PER_HOST)
    p, a = b["payload"], b["acc"]
    fl = cm.flat_levels(ep, b["share_intra"], b["share_inter"])[0]
    outer, inner = cm.Level(hosts, 0.0, 1.0), cm.Level(local, 1.0, 0.0)
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
    found = dict(flat=max(flat_l), hier=hier_line, nvlink=max(nvl_l), hosts=hosts)
    sl = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
    cells = [
        ep,
        hosts,
        sl(flat_l),
        f"{max(flat_l):,.0f}",
        sl(out_l) if hosts > 1 else "- (one host)",
        sl(nvl_l),
        f"{hier_line:,.0f}",
        f"{max(flat_l) / hier_line:.2f}" if hosts > 1 else "-",
    ]
    return found, table_row(cells)


def lines_section(args, model_in, secs, links):
    """Prints where each ring stops hiding its transfers; returns {ep: `_lines`' dict}."""
    print("\n### Where the ring stops hiding its transfers (tokens per device)\n")
    print(
        "A hop's compute grows with T, expert routing's transfer does not: below the line the "
        "hop waits for its transfer. flat: one hop's compute = one hop's transfer over its "
        "slowest link (NIC beyond one host); hier: a round's L hops of compute = the round's "
        "NIC transfer (the NIC line / L), and one hop's compute = its NVLink transfer (the "
        "NVLink line, the floor); each the larger of fwd and bwd\n"
    )
    print_head(LINES_HEAD)
    lines = {}
    t_ref = max(args.tokens)
    for ep in args.ep:
        per_tok = tuple(c / t_ref for c in secs[ep, t_ref][:2])  # compute s per token
        lines[ep], line = _lines(ep, model_in[ep][3], per_tok, links)
        print(line)
    return lines


FP8_HEAD = (
    "EP",
    "hosts",
    "P bf16 / e4m3 MiB",
    "flat line: bf16",
    "FP8 relay fwd / bwd",
    "FP8 relay",
    "+ e4m3 kernel",
    "hier line: bf16",
    "FP8 relay",
    "+ e4m3 kernel",
)


def fp8_lines_section(args, model_in, secs, links, shape, lines):
    """Prints the lines with `expert_fp8`'s relay (P as e4m3 + block scales; the f32 dW
    accumulator as before), at bf16-rate matmuls and with the e4m3 kernel's share of them at
    twice that rate (`costmodel.fp8_compute_factors`: assumed until a GPU times it)."""
    print("\n### Where the ring stops hiding its transfers with expert_fp8 (tokens per device)\n")
    f_fwd, f_bwd = cm.fp8_compute_factors()
    print(
        "The same lines with the weights relayed as e4m3 and one float32 scale per 128 x 128 "
        "block (`costmodel.fp8_payload`; the backward's float32 dW accumulator A travels as "
        "before, so a backward hop moves P/2 + A instead of P + A): at bf16 compute (the "
        "grouped matmuls' 16-bit kernel, as where there is no e4m3 kernel), and with the e4m3 "
        "kernel of Hopper (`gmm_fp8`: the forward, the recomputed projections and the dgrads "
        f"at the tensor cores' 2x bf16 rate, the wgrads 16-bit: a hop's compute x{f_fwd:.4g} "
        f"forward, x{f_bwd:.4g} backward; the rate assumed until a GPU times the kernel)\n"
    )
    print_head(FP8_HEAD)
    t_ref, (_, hidden, ffn) = max(args.tokens), shape
    mib = lambda b: f"{b / 2**20:,.1f}"
    for ep in args.ep:
        b = model_in[ep][3]
        b8 = dict(b, payload=cm.fp8_payload(int(b["payload"]), hidden, ffn))
        per_tok = tuple(c / t_ref for c in secs[ep, t_ref][:2])
        relay, _ = _lines(ep, b8, per_tok, links)
        fast, _ = _lines(ep, b8, (per_tok[0] * f_fwd, per_tok[1] * f_bwd), links)
        fl = cm.flat_levels(ep, b8["share_intra"], b8["share_inter"])[0]
        p8, a = b8["payload"], b8["acc"]
        fwd_bwd = [
            cm.threshold_tokens(cm.transfer_time(nb, fl, links), ft, 1.0)
            for nb, ft in zip((p8, p8 + a), per_tok)
        ]
        hier = lambda d: f"{d['hier']:,.0f}" if d["hosts"] > 1 else "-"
        cells = [
            ep,
            relay["hosts"],
            f"{mib(b['payload'])} / {mib(p8)}",
            f"{lines[ep]['flat']:,.0f}",
            " / ".join(f"{x:,.0f}" for x in fwd_bwd),
            f"{relay['flat']:,.0f}",
            f"{fast['flat']:,.0f}",
            hier(lines[ep]),
            hier(relay),
            hier(fast),
        ]
        print(table_row(cells))


# ---------------------------------------------------------------- in words


def rates_text(rates) -> str:
    """The compute rates in a few words, e.g. 'fwd 312.5 / bwd 288.1 TFLOP/s, measured'."""
    kind = lambda r: "measured" if r.measured else "assumed"
    same = kind(rates.fwd) == kind(rates.bwd)
    return f"fwd {rates.fwd.tflops:.4g} / bwd {rates.bwd.tflops:.4g} TFLOP/s, " + (
        kind(rates.fwd) if same else f"{kind(rates.fwd)} / {kind(rates.bwd)}"
    )


def _one_host(r, line, t_paper):
    return (
        f"- One host, EP=8, T={t_paper:,} per GPU: flat ring {r['flat'] * 1e3:,.1f} ms, "
        f"all-to-all {r['a2a'] * 1e3:,.1f} ms per layer (a2a / ring "
        f"{r['a2a'] / r['flat']:.2f}x); the ring's hops are compute-bound above "
        f"T = {line:,.0f} (NVLink line), so it costs its compute "
        f"({r['compute'] * 1e3:,.1f} ms) and the all-to-all pays its exchange "
        f"({r['a2a_comm'] * 1e3:,.1f} ms) on top of less compute (no recompute). Were the "
        f"all-to-all's forward recomputed in its backward as the ring's is (its FLOPs only, "
        f"its all-to-alls not repeated): {r['a2a_remat'] * 1e3:,.1f} ms, a2a / ring "
        f"{r['a2a_remat'] / r['flat']:.2f}x."
    )


def _span(xs, f):
    return f(min(xs)) if f(min(xs)) == f(max(xs)) else f"{f(min(xs))}-{f(max(xs))}"


def _multi_host(lines, multi):
    fl_ = [lines[ep]["flat"] for ep in multi]
    hl_ = [lines[ep]["hier"] for ep in multi]
    nv_ = [lines[ep]["nvlink"] for ep in multi]
    tok = lambda x: f"{x:,.0f}"
    moved = [f / h for f, h in zip(fl_, hl_)]
    hosts_ = [ep // GPUS_PER_HOST for ep in multi]
    return (
        f"- Over {_span(hosts_, str)} hosts (EP {', '.join(map(str, multi))}): the flat "
        f"ring is network-bound below T = {_span(fl_, tok)} tokens per GPU (a hop's NIC "
        f"transfer outlasts its compute); the hierarchical ring moves that line to T = "
        f"{_span(hl_, tok)}, {_span(moved, lambda x: f'{x:.2f}')}x fewer tokens (L = "
        f"{GPUS_PER_HOST}; its floor, the NVLink line, is T = {_span(nv_, tok)})."
    )


def _by_ep(pred, eps, t):
    return (
        f"- By EP at T={t:,} per GPU: a2a / flat ring "
        + ", ".join(f"{pred[ep, t]['a2a'] / pred[ep, t]['flat']:.2f}x (EP {ep})" for ep in eps)
        + "; a2a / hierarchical ring "
        + ", ".join(f"{pred[ep, t]['a2a'] / pred[ep, t]['hier']:.2f}x (EP {ep})" for ep in eps)
        + "."
    )


def statements_section(args, rates, pred, lines):
    """Prints what the model says, in words."""
    print("\n### What the model says\n")
    t_paper = args.scaling_tokens
    if 8 in args.ep and t_paper in args.tokens:
        print(_one_host(pred[8, t_paper], lines[8]["flat"], t_paper))
    multi = [ep for ep in args.ep if lines[ep]["hosts"] > 1]
    if multi:
        print(_multi_host(lines, multi))
    for t in sorted({t_paper, 98304} & set(args.tokens)):
        print(_by_ep(pred, args.ep, t))
    print(
        f"- Both lines scale with the compute rates (here {rates_text(rates)}) and inversely "
        f"with the link's bandwidth."
    )


# ---------------------------------------------------------------- the plot


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
