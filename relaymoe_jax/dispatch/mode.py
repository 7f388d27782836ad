"""Per-hop ring volume of expert routing vs token routing (RelayMoE paper, Table 2).

Per hop of a ring over EP devices, forward:
  expert routing moves the visiting expert partition: E/EP experts x W/ETP bytes, with
    W = 3 * hidden * ffn * itemsize(weight_dtype)   (SwiGLU gate, up and down matrices);
  token routing moves the local token partition and its routing metadata:
    B*S/(SP*CP) tokens x (H + M) bytes, with H = hidden * itemsize(act_dtype) and
    M = top_k * (4 + itemsize(router_dtype))   (an int32 pair index and a router weight per slot).
Backward moves twice as much in either mode.

What relaymoe_jax's ring actually sends per hop (`sent_*`) adds the accumulators that travel, in
float32, beside what Table 2 counts (the benchmark checks these against the compiled HLO):
  expert routing, backward: the trailing dW accumulator, W/ETP * 4/itemsize(weight) per expert;
  token routing, forward: the output accumulator, 4*H per token;
  token routing, backward: dy (H per token) and the dx and d expert_weights accumulators
    (4*H + 4*top_k per token) instead of a second copy of the tokens;
  token routing, both: the pair order's padding by one chunk and the per-expert counts,
    (chunk + E) * 4 per partition.
Per link class (`link_bytes`): a ring over EP devices on `hosts` hosts (L = EP / hosts GPUs each)
moves a payload N - 1 times per pass. Flat, every hop crosses a host boundary for the GPU at it, so
the busiest GPU sends all (N - 1) hops' bytes across hosts. Hierarchical (`dispatch/ring.py`),
every GPU sends hosts - 1 payloads across hosts and hosts * (L - 1) within its host.
`routing="auto"` picks the mode that sends fewer bytes on the slowest link class it uses
(across hosts when the ring spans several, else within one), then on the other; tie: "expert".
Both classes carry the same payloads a fixed number of times, so the classes agree on the choice:
it is the mode with fewer sent forward + backward bytes per hop.
"""

import dataclasses

import jax.numpy as jnp

from relaymoe_jax.dispatch.chunking import default_chunk
from relaymoe_jax.dispatch.experts import check_experts_divide
from relaymoe_jax.util.checks import is_int


def _bytes(n: float) -> str:
    """`n` bytes in decimal units to 3 significant figures, e.g. 1.21 GB."""
    x, units = float(n), ("B", "kB", "MB", "GB", "TB", "PB")
    i = 0
    while float(f"{x:.3g}") >= 1000 and i < len(units) - 1:
        x, i = x / 1000, i + 1
    return f"{x:.3g} {units[i]}" if i else f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class RoutingVolumes:
    """Bytes one device sends per ring hop under each routing mode (Table 2)."""

    expert_fwd: int  # Table 2 bytes per hop, forward, expert routing  = E/EP * W/ETP
    expert_bwd: int  # 2 * expert_fwd
    token_fwd: int  # tokens_per_device * (H + M)
    token_bwd: int  # 2 * token_fwd
    sent_expert_fwd: int  # what the ring sends per hop (module docstring)
    sent_expert_bwd: int
    sent_token_fwd: int
    sent_token_bwd: int
    choice: str  # "expert" | "token": lower sent fwd + bwd bytes; tie -> "expert"
    experts_per_device: int  # E / EP
    expert_bytes: int  # W / ETP
    tokens_per_device: int  # B*S/(SP*CP)
    token_bytes: int  # H + M (bytes)
    ep: int = 1  # devices of the ring
    hosts: int = 1  # hosts they are on
    hierarchical: bool = False  # the ring: an inner ring per host, one transfer per round

    def link_bytes(self, mode: str) -> tuple[int, int]:
        """(within a host, across hosts): the bytes the busiest GPU sends per layer, forward +
        backward, in `mode` ("expert" or "token"); see the module docstring."""
        per = getattr(self, f"sent_{mode}_fwd") + getattr(self, f"sent_{mode}_bwd")
        n, m = self.ep, self.hosts
        if m == 1:
            return (n - 1) * per, 0
        if self.hierarchical:
            return m * (n // m - 1) * per, (m - 1) * per
        return (n - 1) * per, (n - 1) * per

    def explain(self) -> str:
        """One line: the choice, both forward per-hop volumes and what they are made of."""
        sent = lambda m: _bytes(getattr(self, f"sent_{m}_fwd") + getattr(self, f"sent_{m}_bwd"))
        links = (
            ""
            if self.hosts == 1
            else (
                f"; per GPU per layer on {self.hosts} hosts "
                f"({'hierarchical' if self.hierarchical else 'flat'} ring), "
                + " vs ".join(
                    f"{m} {_bytes(self.link_bytes(m)[1])} across hosts + "
                    f"{_bytes(self.link_bytes(m)[0])} within"
                    for m in ("expert", "token")
                )
            )
        )
        return (
            f"routing {self.choice!r}: per-hop fwd+bwd bytes sent expert {sent('expert')} vs "
            f"token {sent('token')}; Table 2 forward: expert {_bytes(self.expert_fwd)} "
            f"({self.experts_per_device} experts x {_bytes(self.expert_bytes)}) vs token "
            f"{_bytes(self.token_fwd)} ({self.tokens_per_device} tokens x {self.token_bytes} B)"
            + links
        )


def _size(name: str, value) -> int:
    if not (is_int(value) and value > 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _itemsize(name: str, dtype) -> int:
    try:
        size = jnp.dtype(dtype).itemsize if dtype is not None else 0
    except (TypeError, ValueError):
        size = 0
    if size <= 0:
        raise ValueError(f"{name} must be a dtype (e.g. 'bfloat16', jnp.float32), got {dtype!r}")
    return size


def routing_volumes(
    *,
    experts,
    top_k,
    hidden,
    ffn,
    ep,
    tokens_per_device=None,
    batch=None,
    seq_len=None,
    sp=1,
    cp=1,
    etp=1,
    act_dtype="bfloat16",
    weight_dtype=None,
    router_dtype="float32",
    chunk=None,
    hosts=1,
    hierarchical=False,
) -> RoutingVolumes:
    """Per-hop forward/backward bytes of expert and token routing, and the cheaper mode.

    expert_fwd = experts/ep * W/etp,  W = 3 * hidden * ffn * itemsize(weight_dtype);
    token_fwd = tokens_per_device * (H + M),  H = hidden * itemsize(act_dtype),
    M = top_k * (4 + itemsize(router_dtype));  *_bwd = 2 * *_fwd.
    Give `tokens_per_device`, or `batch` and `seq_len` (then tokens_per_device =
    batch * seq_len / (sp * cp)). `weight_dtype` defaults to `act_dtype`. `chunk` is the ring's
    chunk size (default: `dispatch.chunking.default_chunk`). `hosts`: the hosts the
    ep devices are on; `hierarchical`: the ring is hierarchical over them (for `link_bytes` and
    the choice). Bad arguments raise ValueError naming the argument.
    """
    e, k, h, f = (
        _size(n, v)
        for n, v in (("experts", experts), ("top_k", top_k), ("hidden", hidden), ("ffn", ffn))
    )
    ep, sp, cp, etp = (_size(n, v) for n, v in (("ep", ep), ("sp", sp), ("cp", cp), ("etp", etp)))
    if (tokens_per_device is None) == (batch is None and seq_len is None):
        raise ValueError(
            "give exactly one of tokens_per_device or (batch and seq_len), got "
            f"tokens_per_device={tokens_per_device!r}, batch={batch!r}, "
            f"seq_len={seq_len!r}"
        )
    if tokens_per_device is not None:
        tokens = _size("tokens_per_device", tokens_per_device)
    else:
        b, s = _size("batch", batch), _size("seq_len", seq_len)
        if (b * s) % (sp * cp):
            raise ValueError(
                f"batch * seq_len must be divisible by sp * cp, got batch={b}, "
                f"seq_len={s}, sp={sp}, cp={cp}"
            )
        tokens = b * s // (sp * cp)
    check_experts_divide(e, ep, name="experts", axis="the expert axis (ep)")
    if f % etp:
        raise ValueError(f"ffn must be divisible by etp, got ffn={f}, etp={etp}")
    if k > e:
        raise ValueError(f"top_k must be <= experts, got top_k={k}, experts={e}")
    hosts = _size("hosts", hosts)
    if ep % hosts:
        raise ValueError(f"ep must be divisible by hosts, got ep={ep}, hosts={hosts}")
    act = _itemsize("act_dtype", act_dtype)
    weight = act if weight_dtype is None else _itemsize("weight_dtype", weight_dtype)
    router = _itemsize("router_dtype", router_dtype)

    c = default_chunk(tokens, k, ep, e) if chunk is None else _size("chunk", chunk)

    per_device, expert_bytes = e // ep, 3 * h * f * weight // etp
    token_bytes = h * act + k * (4 + router)
    expert_fwd, token_fwd = per_device * expert_bytes, tokens * token_bytes
    sent_expert_bwd = per_device * 3 * h * f * (weight + 4) // etp
    pads = (c + e) * 4
    sent_token_fwd = token_fwd + tokens * h * 4 + pads
    sent_token_bwd = tokens * (2 * h * act + k * (4 + router) + 4 * h + 4 * k) + pads
    vol = RoutingVolumes(
        expert_fwd=expert_fwd,
        expert_bwd=2 * expert_fwd,
        token_fwd=token_fwd,
        token_bwd=2 * token_fwd,
        sent_expert_fwd=expert_fwd,
        sent_expert_bwd=sent_expert_bwd,
        sent_token_fwd=sent_token_fwd,
        sent_token_bwd=sent_token_bwd,
        choice="expert",
        experts_per_device=per_device,
        expert_bytes=expert_bytes,
        tokens_per_device=tokens,
        token_bytes=token_bytes,
        ep=ep,
        hosts=hosts,
        hierarchical=bool(hierarchical),
    )
    slow_first = lambda mode: vol.link_bytes(mode)[::-1]  # (across hosts, within one)
    cheaper = slow_first("expert") <= slow_first("token")
    return dataclasses.replace(vol, choice="expert" if cheaper else "token")
