"""A cost model on paper: per-layer time (forward + backward) of the all-to-all, the flat ring and
the hierarchical ring, for what cannot be timed here (multi-node H100 clusters).

It is a model, not a measurement. Its inputs are measured where this project can measure them:
the bytes each GPU sends come from the compiled XLA:GPU programs (`benchmarks/scaling.py`'s JSON:
collective-permute and all-to-all bytes per device by link class, and one ring hop's bytes), the
FLOPs from XLA:CPU's `cost_analysis()` of a stand-in program (`standin_flops`). What it adds is
three assumed constants and one simple rule per dispatcher.

Constants (public spec figures; override them with the command's flags):
  NVLINK_GBS = 450   NVLink 4 on an H100 SXM: 18 links, 900 GB/s bidirectional per GPU, i.e.
                     450 GB/s per direction (NVIDIA H100 Tensor Core GPU datasheet).
  NIC_GBS = 50       InfiniBand NDR, one ConnectX-7 per GPU: 400 Gb/s = 50 GB/s per direction
                     (NVIDIA ConnectX-7 / DGX H100: 8 x 400 Gb/s compute NICs for 8 GPUs).
  H100_BF16_TFLOPS = 989.4   H100 SXM dense bf16 tensor-core peak (datasheet: 1,979 TFLOP/s is
                     with 2:4 sparsity; dense is half).
  EFFICIENCY = 0.35  the fraction of that peak the expert matmuls reach: this project's Pallas
                     grouped matmul ran forward+backward at 314-357 TFLOP/s (32-36% of 989.4) on a
                     real H200 (BENCHMARKS.md, "On a real H200"); an H200 has the H100's tensor
                     cores (same 989.4 peak) and more HBM bandwidth.
  DEFAULT_TFLOPS = 0.35 x 989.4 = 346.3 TFLOP/s.

Measured compute (`load_rates`): where the prepared GPU run's JSON exists
(`python benchmarks/gpu.py --json benchmarks/results/gpu.json` on one H100/H200, MEASUREMENTS), the
forward and backward compute rates come from it instead: one ring hop at the paper shape, timed
(its "One ring hop" section, the default chunk), else its kernels (the default Pallas config).
Each figure says whether it is measured (file, device, date) or assumed (0.35 x peak). A measured
rate counts FLOPs as that run does (`hop_flops`: 6 and 12 x pairs x H x F, forward and backward),
so the model's hop compute is the measured hop time scaled by pairs x H x F; the all-to-all's
backward, which recomputes nothing, takes 12/16 of the ring's backward time per pair (the ring's
backward hop runs 8 matmuls, 2 of them its recompute; `ComputeRates.backward_s`). Assumed rates
apply to the stand-in's FLOPs, as before.

Bytes (`flat_ring_bytes`, `hier_ring_check`), per GPU:
  P     one payload transfer (an expert partition's weights, bf16): the compiled forward loop
        body's collective-permute bytes (`hop_fwd`);
  A     the dW accumulator trailing its weights (f32): the compiled backward loop body's bytes
        (`hop_bwd`, payload + accumulator) minus P;
  tail  dW's return home after the last hop: what the compiled backward (fwd+bwd program minus
        forward) sends beyond its hops (it is P, not A: XLA converts dW to bf16 first);
  share_c  which link a hop uses, for the GPU that sends most: max over GPUs of its class-c bytes
        / max over GPUs of all its bytes (fwd+bwd program). A flat ring over H > 1 hosts: the
        boundary GPU sends every hop across hosts, the others over NVLink, so both shares are 1;
        one host: intra 1, inter 0. The hierarchical ring: its outer ring crosses hosts, its
        inner one does not.
The hop schedule is `dispatch/ring.py`'s `relay` (`relay_sends`); its totals are checked against
the compiled totals of both rings (`flat_ring_bytes`' fwd_resid, `hier_ring_check`).

FLOPs (`standin_flops`): XLA:GPU gives no `cost_analysis()` for these programs (it returns None),
and XLA counts a while loop's body once, so the ring's loops could not be read anyway. The
stand-in does one hop's exact work under balanced routing: the E/EP local experts each see
T*k/E of this device's pairs, a dense batched SwiGLU [E_l, n, H] x [E_l, H, F] (forward, router
weights applied) and its VJP. The ring's hop: forward + the VJP program (which recomputes the
forward: the ring's backward recomputes per hop); the all-to-all: forward + the backward from
saved residuals, over all T*k pairs of the device once (E_l experts x EP*n pairs). Per pair that
is about 3 + 9 = 12 units of 2*H*F for the ring and 3 + 6 = 9 for the all-to-all (a check only;
the model uses the compiled counts). The ring's real backward hop (`dispatch/hop.py`) recomputes
gate and up but not the down projection (it gets d router weight from dy @ W_down^T), 11 units:
the stand-in overstates the ring's compute by about 1/12, against the ring.

The rules (seconds; c = FLOPs / throughput; t(b) = max(share_intra*b/NVLink, share_inter*b/NIC),
the busiest GPU's slowest link):
  one ring pass = sum over its hops of max(c, t(bytes of the hop)) + t(tail): each hop waits for
      its slowest transfer or its compute, whichever is longer (the transfer of the next hop
      overlaps this hop's compute); the tail (the accumulator's final return home) overlaps
      nothing.
  flat ring = forward pass + backward pass over EP positions.
  hierarchical ring = the same rule nested: a round is a whole inner pass over the L GPUs of a
      host (NVLink), and an outer pass over the M hosts has one round per hop (the payload goes to
      the next host, NIC, while the round's L hops compute). Per round about
      max(L * max(c, t_intra), t_inter).
  all-to-all = compute (no recompute) + its all-to-all bytes at max(intra/NVLink, inter/NIC),
      not overlapped.
Ignored: latency per transfer or kernel, kernel efficiency at small sizes, routing imbalance, the
all-to-all's permutation kernels, the router, contention between GPUs on a NIC or switch, and
whether the compiled schedule really overlaps (it does with `relaymoe_jax.XLA_OPTIONS`, with
which the programs are compiled; tests/test_multinode_gpu.py).
"""

import dataclasses
import json
from pathlib import Path
from typing import Literal

NVLINK_GBS = 450.0
NIC_GBS = 50.0
H100_BF16_TFLOPS = 989.4
EFFICIENCY = 0.35
DEFAULT_TFLOPS = round(EFFICIENCY * H100_BF16_TFLOPS, 1)  # 346.3


@dataclasses.dataclass(frozen=True)
class Links:
    """Per-direction bandwidth of one GPU's links, bytes per second."""

    nvlink: float = NVLINK_GBS * 1e9
    nic: float = NIC_GBS * 1e9


@dataclasses.dataclass(frozen=True)
class Level:
    """One ring: `n` positions; of each transfer, the GPU that sends most sends the share `intra`
    to its own host's GPUs and `inter` to other hosts (0..1 each; both 1 for a flat ring over
    several hosts: the boundary GPU sends all across, the others all over NVLink)."""

    n: int
    intra: float
    inter: float


def transfer_time(nbytes: float, level: Level, links: Links) -> float:
    """Seconds for one transfer of `nbytes` on `level`: its slowest link class."""
    return max(level.intra * nbytes / links.nvlink, level.inter * nbytes / links.nic)


def relay_sends(n: int, payload: float, acc: float = 0.0, tail: float | None = None):
    """(bytes sent at each of the n hops, bytes of the tail) of one pass of `dispatch/ring.py`'s
    `relay` over n positions: without an accumulator (expert routing's forward) the payload moves
    n-1 times and the last hop sends nothing; with one (the backward's dW) hop 0 sends the
    payload, hops 1..n-2 the payload and the accumulator trailing it, hop n-1 the accumulator, and
    the tail returns it home after the last hop's compute (`tail` bytes; default `acc`: the
    compiled programs send the finished dW in the weights' dtype, see `flat_ring_bytes`). A ring
    of two sends no accumulator: hop 0 sends the payload, and the tail brings the other part home
    (float32, `acc`: it is added after it arrives)."""
    if n == 1:
        return [0.0], 0.0
    if not acc:
        return [payload] * (n - 1) + [0.0], 0.0
    if n == 2:
        return [payload, 0.0], acc
    return [payload] + [payload + acc] * (n - 2) + [acc], acc if tail is None else tail


def relay_time(compute: float, transfers, tail: float = 0.0) -> float:
    """One pass: every hop takes max(its compute, its transfer), then the tail."""
    return sum(max(compute, t) for t in transfers) + tail


def pass_time(
    levels, compute: float, payload: float, acc: float, links: Links, tail: float | None = None
) -> float:
    """One pass over nested rings, outermost first: each hop of an outer ring is a whole pass of
    the inner ones (a round), with its own payload transfer overlapping the round. `tail`: the
    outermost ring's final return (default `acc`); an inner ring returns its round's partial
    accumulator, `acc`."""
    level, *inner = levels
    c = pass_time(inner, compute, payload, acc, links) if inner else compute
    sends, last = relay_sends(level.n, payload, acc, tail)
    return relay_time(
        c, [transfer_time(b, level, links) for b in sends], transfer_time(last, level, links)
    )


def ring_layer_time(
    levels,
    c_fwd: float,
    c_bwd: float,
    payload: float,
    acc: float,
    links: Links,
    tail: float | None = None,
) -> dict:
    """Forward (payload only) + backward (payload + trailing accumulator) of expert routing, s.
    `c_fwd` / `c_bwd`: one hop's compute (backward: recompute + gradients); `tail`: the dW's
    final return (default `acc`)."""
    fwd = pass_time(levels, c_fwd, payload, 0.0, links)
    bwd = pass_time(levels, c_bwd, payload, acc, links, tail)
    return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def flat_levels(ep: int, share_intra: float, share_inter: float):
    return [Level(ep, share_intra, share_inter)]


def hier_levels(hosts: int, gpus_per_host: int):
    """Outer ring over the hosts (every transfer crosses hosts), inner over one host's GPUs; on
    one host just the inner ring (the flat ring over NVLink)."""
    inner = Level(gpus_per_host, 1.0, 0.0)
    return [inner] if hosts == 1 else [Level(hosts, 0.0, 1.0), inner]


def alltoall_time(
    flops: float, intra_bytes: float, inter_bytes: float, flops_per_s: float, links: Links
) -> dict:
    """Compute, then the all-to-alls at the slower of the two link classes; nothing overlaps."""
    return alltoall_time_s(flops / flops_per_s, intra_bytes, inter_bytes, links)


def alltoall_time_s(compute_s: float, intra_bytes: float, inter_bytes: float, links: Links) -> dict:
    """`alltoall_time` with the compute given in seconds."""
    comm = max(intra_bytes / links.nvlink, inter_bytes / links.nic)
    return {"compute": compute_s, "comm": comm, "total": compute_s + comm}


def threshold_tokens(transfer_s: float, flops_per_token: float, flops_per_s: float) -> float:
    """Tokens per device at which a hop's compute (flops_per_token * T / throughput) equals a
    transfer of `transfer_s`: below it the hop waits for its transfer. For expert routing the
    transfer does not depend on T, so the line is one T per EP and link."""
    return transfer_s * flops_per_s / flops_per_token


def bound(c: float, t: float) -> bool:
    """A hop is transfer-bound when its transfer takes longer than its compute."""
    return t > c


# ------------------------------------------------------------------ from the compiled figures


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


# ------------------------------------------------------------------ FLOPs: the stand-in


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


# ------------------------------------------------------------------ measured compute rates

HOP_FWD_UNITS = 6  # FLOPs per pair per H*F the GPU run counts for a hop's forward: 3 matmuls
HOP_BWD_UNITS = 12  # and for its backward: the 6 gradient matmuls (a recompute not counted)
RING_BWD_UNITS = 16  # what the ring's backward hop computes: 2 recomputed matmuls + those 6
REPO = Path(__file__).resolve().parents[1]
MEASUREMENTS = REPO / "benchmarks" / "results" / "gpu.json"  # `benchmarks/gpu.py --json` writes it
Origin = Literal["hop", "kernels", "assumed"]


def hop_flops(pairs: int, hidden: int, ffn: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of a hop of `pairs` pairs as the GPU run counts them."""
    return (
        float(HOP_FWD_UNITS) * pairs * hidden * ffn,
        float(HOP_BWD_UNITS) * pairs * hidden * ffn,
    )


@dataclasses.dataclass(frozen=True)
class Rate:
    """One grouped-matmul throughput, TFLOP/s, and where it comes from: "hop" (the GPU run's
    ring hop, whose backward also recomputes), "kernels" (its kernel section: the default Pallas
    config, balanced groups; no recompute) or "assumed" (no measurement)."""

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
    """The compute rates from a `benchmarks/gpu.py --json` file: each of forward and backward
    from its hop section (the default-chunk row), else from its kernel section (the default
    Pallas config on balanced groups at K, N = hidden, ffn or ffn, hidden: total FLOPs / total
    time; backward: dx and dW), else `assumed_tflops`. `path` None: MEASUREMENTS if it exists
    (all assumed if not); a given path must exist. Raises MeasurementError for a malformed file."""
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
    """[(fwd TFLOP/s, note) or None, (bwd ..., note) or None] from the default-chunk hop row."""
    out = [None, None]
    for i in range(len(rows)):
        r, w = _row(rows, i, path, "hop")
        if not _field(r, "default_chunk", bool, path, w):
            continue
        note = (
            f"hop section: {_field(r, 'pairs', int, path, w):,} pairs, "
            f"H={_field(r, 'hidden', int, path, w)}, F={_field(r, 'ffn', int, path, w)}, "
            f"chunk {_field(r, 'chunk', int, path, w):,}"
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
