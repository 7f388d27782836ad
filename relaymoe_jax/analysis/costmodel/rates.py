"""The cost model's compute rates: measured (a `benchmarks/gpu.py --json` file, `load_rates`)
or assumed (a fraction of the H100 SXM's dense bf16 peak), and the FLOPs a hop counts.

Constants: H100_BF16_TFLOPS, the H100 SXM dense bf16 tensor-core peak; EFFICIENCY, the fraction
of it the expert matmuls reach (this project's Pallas grouped matmul on a real H200);
DEFAULT_TFLOPS = EFFICIENCY x the peak. The package docstring gives their sources.
"""

import dataclasses
import json
from pathlib import Path
from typing import Literal

H100_BF16_TFLOPS = 989.4
EFFICIENCY = 0.35
DEFAULT_TFLOPS = round(EFFICIENCY * H100_BF16_TFLOPS, 1)  # 346.3

HOP_FWD_UNITS = 6  # FLOPs per pair per H*F the GPU run counts for a hop's forward: 3 matmuls
HOP_BWD_UNITS = 12  # and for its backward: the 6 gradient matmuls (a recompute not counted)
RING_BWD_UNITS = 16  # what the ring's backward hop computes: 2 recomputed matmuls + those 6
# expert_fp8 on Hopper: the e4m3 kernel runs the forward's matmuls and, of the backward hop's 16
# units, the 2 recomputed and the 3 dgrads (10 units); the 3 wgrads (6) stay 16-bit
# (docs/precision.md). At an e4m3 rate `speedup` times bf16's (2 on H100 and H200: the tensor
# cores' ratio, assumed until a GPU measures the kernel) a hop's compute scales by these.
FP8_BWD_E4M3_UNITS = 10


def fp8_compute_factors(speedup: float = 2.0) -> tuple[float, float]:
    """(forward, backward) compute time of a ring hop with the e4m3 kernel over the bf16 hop's."""
    e4m3 = FP8_BWD_E4M3_UNITS / RING_BWD_UNITS
    return 1.0 / speedup, e4m3 / speedup + (1.0 - e4m3)


REPO = Path(__file__).resolve().parents[3]  # the checkout: relaymoe_jax/analysis/costmodel/
MEASUREMENTS = REPO / "benchmarks" / "results" / "gpu.json"  # `benchmarks/gpu.py --json` writes it
Origin = Literal["hop", "kernels", "attention", "assumed"]
ATTN_BWD_UNITS = 2.5  # the GPU run's attention backward FLOPs per forward FLOP (FlashAttention's
# convention: five matmuls to the forward's two, the scores recomputed)


def hop_flops(pairs: int, hidden: int, ffn: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a hop of `pairs` pairs as the GPU run counts them."""
    return (
        float(HOP_FWD_UNITS) * pairs * hidden * ffn,
        float(HOP_BWD_UNITS) * pairs * hidden * ffn,
    )


@dataclasses.dataclass(frozen=True)
class Rate:
    """One throughput, TFLOP/s, and where it comes from: "hop" (the GPU run's ring hop, whose
    backward also recomputes), "kernels" (its kernel section: the default Pallas config, balanced
    groups; no recompute), "attention" (its attention section: our kernel, plain causal, the
    longest sequence timed) or "assumed" (no measurement)."""

    tflops: float
    origin: Origin
    source: str

    @property
    def measured(self) -> bool:
        return self.origin != "assumed"


@dataclasses.dataclass(frozen=True)
class ComputeRates:
    """The forward and backward compute rates of the cost model, measured or assumed.

    Measured rates count FLOPs as the GPU run does (`hop_flops`), so a measured time scales with
    pairs * H * F; assumed ones apply to the stand-in's FLOPs (`standin_flops`), as before."""

    fwd: Rate
    bwd: Rate

    def forward_s(self, standin: float, pairs: int, hidden: int, ffn: int) -> float:
        """Seconds of a forward over `pairs` pairs; `standin`: its stand-in FLOPs."""
        flops = hop_flops(pairs, hidden, ffn)[0] if self.fwd.measured else standin
        return flops / (self.fwd.tflops * 1e12)

    def backward_s(
        self, standin: float, pairs: int, hidden: int, ffn: int, recompute: bool
    ) -> float:
        """Seconds of a backward over `pairs` pairs, with the forward's gate and up recomputed
        (the ring's) or not (the all-to-all's); `standin`: its stand-in FLOPs. A rate measured
        on the ring's hop covers RING_BWD_UNITS of work per HOP_BWD_UNITS counted, the kernels'
        HOP_BWD_UNITS: the time is scaled to the work asked for."""
        if not self.bwd.measured:
            return standin / (self.bwd.tflops * 1e12)
        base = hop_flops(pairs, hidden, ffn)[1] / (self.bwd.tflops * 1e12)
        done = RING_BWD_UNITS if self.bwd.origin == "hop" else HOP_BWD_UNITS
        return base * (RING_BWD_UNITS if recompute else HOP_BWD_UNITS) / done

    def report(self) -> list[str]:
        """One line per figure: what it is and where it comes from."""
        return [
            f"forward compute: {self.fwd.tflops:,.4g} TFLOP/s, {self.fwd.source}",
            f"backward compute: {self.bwd.tflops:,.4g} TFLOP/s, {self.bwd.source}",
        ]


class MeasurementError(ValueError):
    """A measurements JSON that is not what `benchmarks/gpu.py --json` writes."""


def assumed_rate(tflops: float = DEFAULT_TFLOPS) -> Rate:
    return Rate(
        tflops,
        "assumed",
        f"assumed ({tflops / H100_BF16_TFLOPS:.3f} x the H100 SXM "
        f"dense bf16 peak {H100_BF16_TFLOPS})",
    )


def load_rates(
    path=None, *, assumed_tflops: float = DEFAULT_TFLOPS, hidden: int = 2048, ffn: int = 768
) -> ComputeRates:
    """The compute rates from a `benchmarks/gpu.py --json` file: each of forward and backward from
    its hop section (the row of the default chunk and grouped matmul), else from its kernel section
    (the default Pallas config on balanced groups at K, N = hidden, ffn or ffn, hidden: total FLOPs
    / total time; backward: dx and dW), else `assumed_tflops`. `path` None: MEASUREMENTS if it
    exists (all assumed if not); a given path must exist. Raises MeasurementError for a malformed
    file."""
    if path is None and not MEASUREMENTS.is_file():
        return ComputeRates(assumed_rate(assumed_tflops), assumed_rate(assumed_tflops))
    path = Path(MEASUREMENTS if path is None else path)
    doc = _read_json(path)
    where = f"{_shown(path)}, {_field(doc, 'device', str, path)}, {_field(doc, 'date', str, path)}"
    if _field(doc, "interpret", bool, path, optional=True):
        where += "; a CPU interpreter run (--interpret): not GPU figures"
    hop = _hop_rates(_field(doc, "hop", list, path), path)
    kern = _kernel_rates(_field(doc, "kernels", list, path), path, hidden, ffn)
    picked = []
    for i in (0, 1):
        got = hop[i] or kern[i]
        picked.append(
            assumed_rate(assumed_tflops)
            if got is None
            else Rate(got[0], "hop" if hop[i] else "kernels", f"measured ({where}; {got[1]})")
        )
    return ComputeRates(*picked)


def load_attention_rates(path=None, *, assumed_tflops: float = DEFAULT_TFLOPS) -> tuple[Rate, Rate]:
    """(forward, backward) rates of causal attention from a `benchmarks/gpu.py --json` file: its
    attention section's row of our kernel (impl "pallas") without documents at the longest
    sequence timed with both figures (the backward counted as ATTN_BWD_UNITS x the forward's
    FLOPs), else `assumed_tflops` (as `load_rates`, an `--interpret` run's figures are taken and
    said to be). `path` None: MEASUREMENTS if it exists. Raises MeasurementError for a malformed
    file."""
    assumed = (assumed_rate(assumed_tflops), assumed_rate(assumed_tflops))
    if path is None and not MEASUREMENTS.is_file():
        return assumed
    path = Path(MEASUREMENTS if path is None else path)
    doc = _read_json(path)
    where = f"{_shown(path)}, {_field(doc, 'device', str, path)}, {_field(doc, 'date', str, path)}"
    if _field(doc, "interpret", bool, path, optional=True):
        where += "; a CPU interpreter run (--interpret): not GPU figures"
    rows = _field(doc, "attention", list, path, optional=True) or []
    best = None  # (tokens, fwd, bwd)
    for i in range(len(rows)):
        r, w = _row(rows, i, path, "attention")
        if _field(r, "impl", str, path, w) != "pallas":
            continue
        if _field(r, "documents", int, path, w, optional=True) is not None:
            continue
        tokens = _field(r, "tokens", int, path, w)
        fwd = _field(r, "fwd_tflops", float, path, w, optional=True)
        bwd = _field(r, "bwd_tflops", float, path, w, optional=True)
        if fwd and bwd and fwd > 0 and bwd > 0 and (best is None or tokens > best[0]):
            best = (tokens, float(fwd), float(bwd))
    if best is None:
        return assumed
    note = f"measured ({where}; attention section: our kernel, causal, {best[0]:,} tokens)"
    return Rate(best[1], "attention", note), Rate(best[2], "attention", note)


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeasurementError(
            f"{path}: no such file (write it with `python benchmarks/gpu.py "
            f"--json {path}` on a GPU)"
        ) from None
    except json.JSONDecodeError as e:
        raise MeasurementError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise MeasurementError(
            f"{path}: expected a JSON object at the top, got {type(doc).__name__}"
        )
    return doc


_KINDS = {
    str: "a string",
    bool: "true or false",
    list: "a list",
    int: "an integer",
    float: "a number",
    dict: "an object",
}


def _field(obj: dict, key: str, kind, path, where: str = "", optional: bool = False):
    """obj[key] checked to be of `kind` (float: any number; None allowed when optional)."""
    name = f"{where}{key}"
    if key not in obj:
        if optional:
            return None
        raise MeasurementError(f"{path}: missing key {name!r} (expected {_KINDS[kind]})")
    value = obj[key]
    if value is None and optional:
        return None
    ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is float
        else isinstance(value, int) and not isinstance(value, bool)
        if kind is int
        else isinstance(value, kind)
    )
    if not ok:
        raise MeasurementError(
            f"{path}: {name}: expected {_KINDS[kind]}"
            f"{' or null' if optional else ''}, got {value!r}"
        )
    return value


def _row(rows: list, i: int, path, section: str) -> tuple[dict, str]:
    where = f"{section}[{i}]."
    if not isinstance(rows[i], dict):
        raise MeasurementError(f"{path}: {section}[{i}]: expected an object, got {rows[i]!r}")
    return rows[i], where


def _hop_rates(rows: list, path) -> list:
    """[(fwd TFLOP/s, note) or None, (bwd ..., note) or None] from the hop row of the default
    chunk and the default grouped matmul (`default_impl`; a file without it has one impl), in
    bf16 (a row with `fp8` true times the FP8 recipe: not the model's rate)."""
    out = [None, None]
    for i in range(len(rows)):
        r, w = _row(rows, i, path, "hop")
        if not _field(r, "default_chunk", bool, path, w):
            continue
        if _field(r, "default_impl", bool, path, w, optional=True) is False:
            continue
        if _field(r, "fp8", bool, path, w, optional=True):
            continue
        impl = _field(r, "impl", str, path, w, optional=True)
        note = (
            f"hop section: {_field(r, 'pairs', int, path, w):,} pairs, "
            f"H={_field(r, 'hidden', int, path, w)}, F={_field(r, 'ffn', int, path, w)}, "
            f"chunk {_field(r, 'chunk', int, path, w):,}" + (f", gmm_impl {impl}" if impl else "")
        )
        for j, key in enumerate(("fwd_tflops", "bwd_tflops")):
            value = _field(r, key, float, path, w, optional=True)
            if value is not None and value > 0:
                out[j] = (float(value), note)
    return out


def _kernel_rates(rows: list, path, hidden: int, ffn: int) -> list:
    """[(fwd TFLOP/s, note) or None, (bwd ..., note) or None] from the kernel section."""
    flops, secs = [0.0, 0.0], [0.0, 0.0]
    for i in range(len(rows)):
        r, w = _row(rows, i, path, "kernels")
        op = _field(r, "op", str, path, w)
        if op not in ("fwd", "dx", "dW"):
            raise MeasurementError(f"{path}: {w}op: expected 'fwd', 'dx' or 'dW', got {op!r}")
        shape = (_field(r, "k", int, path, w), _field(r, "n", int, path, w))
        ms = _field(r, "ms", float, path, w, optional=True)
        tflops = _field(r, "tflops", float, path, w, optional=True)
        if (
            (
                _field(r, "kernel", str, path, w),
                _field(r, "config", str, path, w),
                _field(r, "groups", str, path, w),
            )
            != ("pallas", "default", "balanced")
            or shape not in ((hidden, ffn), (ffn, hidden))
            or not ms
            or not tflops
        ):
            continue
        j = 0 if op == "fwd" else 1
        flops[j] += tflops * 1e12 * ms * 1e-3
        secs[j] += ms * 1e-3
    note = (
        f"kernel section: default Pallas config, balanced groups, K,N = {hidden},{ffn} and "
        f"{ffn},{hidden}"
    )
    return [
        (flops[j] / secs[j] / 1e12, note + (" (dx and dW)" if j else "")) if secs[j] else None
        for j in (0, 1)
    ]
