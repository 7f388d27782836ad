"""Balanced context parallelism: the "zigzag" order of a sequence over a `context` axis.

With the sequence cut into C contiguous pieces (one per device), causal attention gives the
device holding the last piece 2·C - 1 times the work of the first. Cut into 2·C pieces instead,
device c holding pieces c and 2·C - 1 - c, every device holds one early and one late piece and
the causal work is equal (within one diagonal block).

The model runs in that order between its embedding and its final norm (`QwenMoe.hidden`): the
token ids, positions and segment ids enter reordered (`to_zigzag`), the hidden states leave in
the natural order again (`from_zigzag`), so the loss and the logits never see it. Everything in
between is per token (norms, projections, RoPE from the reordered positions, the MoE) except the
attention, which takes each token's index in the sequence from `zigzag_order`. Moving the pieces
is four partial `ppermute`s of one piece each inside a `shard_map`: what one all-to-all of the
activation moves, nothing gathered; their transposes move the gradients back.
"""

import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

ContextLayout = Literal["zigzag", "contiguous"]  # ModelConfig.context_layout
LAYOUTS: tuple[str, ...] = typing.get_args(ContextLayout)


def zigzag_order(s: int, c: int) -> np.ndarray:
    """int32 [S]: the index in the sequence of the token at each place of the zigzag layout
    (device c's share first piece c, then piece 2·C - 1 - c; pieces of S / (2·C) tokens)."""
    if s % (2 * c):
        raise ValueError(f"zigzag: seq {s} is not a multiple of 2 x context = {2 * c}")
    piece = s // (2 * c)
    starts = [p * piece for d in range(c) for p in (d, 2 * c - 1 - d)]
    return np.concatenate([np.arange(a, a + piece) for a in starts]).astype(np.int32)


def zigzag_size(layout: str, attention_impl: str, rules, b: int, s: int) -> int | None:
    """C, the number of devices on the sequence axes, when the zigzag layout applies to a
    [b, s] batch: `layout` "zigzag", a blockwise attention (not "xla", which masks by place),
    the sequence sharded over C > 1 devices and s a multiple of 2·C. Else None."""
    if layout != "zigzag" or attention_impl == "xla":
        return None
    seq = rules.fit((b, s), "batch", "seq")[1]
    if seq is None:
        return None
    c = rules.size("seq")
    return c if c > 1 and s % (2 * c) == 0 else None


def _pairs(c: int):
    """The four partial permutations (source, destination) of one piece each, from the
    natural layout (device d holds pieces 2d, 2d + 1 in slots 0, 1) to the zigzag one (device
    d holds pieces d, 2C - 1 - d), as {(source slot, destination slot): pairs}."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for d in range(c):
        for slot, piece in ((0, d), (1, 2 * c - 1 - d)):
            out.setdefault((piece % 2, slot), []).append((piece // 2, d))
    return out


def _move(x_bs, rules, forward: bool):
    mesh = rules.mesh
    b, s = x_bs.shape[:2]
    batch, seq = rules.fit((b, s), "batch", "seq")
    c = rules.size("seq")
    spec = P(batch, seq, *(None,) * (x_bs.ndim - 2))
    pairs = _pairs(c)
    axes = rules.axes("seq")
    axis = axes[0] if len(axes) == 1 else axes

    def body(x):
        half = x.shape[1] // 2
        slots = (x[:, :half], x[:, half:])
        out = [jnp.zeros_like(slots[0]), jnp.zeros_like(slots[1])]
        for (src, dst), perm in pairs.items():
            if not forward:  # zigzag -> natural: the same moves reversed
                src, dst, perm = dst, src, [(b_, a) for a, b_ in perm]
            out[dst] = out[dst] + lax.ppermute(slots[src], axis, perm)
        return jnp.concatenate(out, axis=1)

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x_bs)


def to_zigzag(x_bs, rules):
    """[B, S, ...] sharded over the sequence axes, natural order -> zigzag order."""
    return _move(x_bs, rules, forward=True)


def from_zigzag(x_bs, rules):
    """The inverse of `to_zigzag`."""
    return _move(x_bs, rules, forward=False)
