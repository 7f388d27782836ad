"""The cost model's timing rules: link bandwidths, ring levels, the relay's bytes per hop, the
time of a (nested) ring pass and of the all-to-all (the rules are in the package docstring).

Constants (public spec figures; `benchmarks/cost_model.py` overrides them with its flags):
NVLINK_GBS, NVLink 4 on an H100 SXM, per direction per GPU; NIC_GBS, one InfiniBand NDR
ConnectX-7 per GPU, per direction.
"""

import dataclasses

NVLINK_GBS = 450.0
NIC_GBS = 50.0


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
