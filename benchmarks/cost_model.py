"""A cost model on paper (not a measurement): per-layer ms, forward + backward, of the all-to-all
(capacity 1.0), the flat ring and the hierarchical ring at EP = 8 to 64 on H100 hosts of 8 GPUs.

Bytes come from the compiled XLA:GPU programs (`benchmarks/scaling.py --json`: per-device
collective-permute and all-to-all bytes by link class, one ring hop's bytes); FLOPs from XLA:CPU's
`cost_analysis()` of a stand-in that does one hop's work under balanced routing; time from two
assumed constants (NVLink and NIC bandwidth per direction), the compute rates (measured on a GPU
where `benchmarks/gpu.py --json` wrote them, else assumed: bf16 throughput) and the rules of
`relaymoe_jax.analysis.costmodel` (its docstring has the formulas and the constants' sources).
Expert routing (what routing="auto" picks at the paper shape). The output starts by saying which
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
import os
import shlex
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules, when loaded by path
    sys.path.append(str(Path(__file__).resolve().parent))

from cost_model_inputs import (
    GPUS_PER_HOST,
    bytes_section,
    flops_section,
    fmt,
    load_rows,
    t_checks_section,
)
from cost_model_predict import (
    fp8_lines_section,
    lines_section,
    plot,
    prediction_section,
    statements_section,
)

from relaymoe_jax.analysis import costmodel as cm
from relaymoe_jax.cli.argtypes import positive_float, positive_int

VARIANTS = ("ring-expert", "hier-expert", "a2a-cap1.0")
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


def print_header(args, shape, rates):
    """Prints what is measured and what assumed: the compute rates, the shape and the links."""
    experts, hidden, ffn = shape
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
        f"# shape: E={experts} k={args.top_k} H={hidden} F={ffn} bf16, expert routing, hosts of "
        f"{GPUS_PER_HOST} H100; assumed: NVLink {fmt(args.nvlink_gbs, 0)} GB/s and NIC "
        f"{fmt(args.nic_gbs, 0)} GB/s per direction per GPU; compute: "
        + (
            "measured rates on the GPU run's FLOP count (6 and 12 x pairs x H x F, "
            "relaymoe_jax.analysis.costmodel.hop_flops), "
            if measured
            else ""
        )
        + ("assumed rates on the stand-in's FLOPs" if len(measured) < 2 else "").rstrip(", ")
    )
    print(
        "# bytes: compiled XLA:GPU programs (benchmarks/scaling.py JSON); FLOPs: XLA:CPU "
        "cost_analysis of the stand-in; rules: relaymoe_jax/analysis/costmodel/",
        flush=True,
    )


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
    links = cm.Links(args.nvlink_gbs * 1e9, args.nic_gbs * 1e9)
    rates = compute_rates(args, shape[1], shape[2])
    print_header(args, shape, rates)
    model_in = bytes_section(args, rows)  # the bytes, from the compiled programs
    t_checks_section(args, rows)
    secs = flops_section(args, shape, rates)  # the FLOPs, from the stand-in
    pred = prediction_section(args, model_in, secs, links)
    lines = lines_section(args, model_in, secs, links)  # where a hop's compute = its transfer
    fp8_lines_section(args, model_in, secs, links, shape, lines)  # the same with expert_fp8
    statements_section(args, rates, pred, lines)
    out = plot(args, rates, pred, lines, Path(args.out))
    print(f"\n# plot: {out}")


if __name__ == "__main__":
    main()
