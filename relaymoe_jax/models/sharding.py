"""Logical axis names -> mesh axes, in one place (`AxisRules`), and the helpers that apply them.

Every array in the model is described by logical axis names:

    name        dimension                                       default mesh axes
    batch       sequences of a batch                            data/fsdp/node/expert (those
                                                                present)
    seq         positions of a sequence                         context, if present
    tokens      flattened batch*seq, the MoE's token axis       batch axes + seq axes
    experts     stacked experts (moe_ffn's expert_axis)         expert, or (node, expert) when
                                                                both; folded: all other axes
    expert_ffn  an expert's ffn (moe_ffn's expert_tensor_axis)  expert_tensor, if present
    embed, heads, kv_heads, head_dim, ffn, vocab, router        replicated
    layers      the stacked layer axis (`scan_layers`)          replicated, always

Default layouts (`rules_for(mesh)`), the four the tests run:
- `("expert",)`: batch and tokens over `expert`, experts over `expert`, the rest replicated.
- `("data", "expert")`: batch and tokens over `("data", "expert")`, experts over `expert`.
- `("node", "expert")` (experts across hosts, docs/multinode.md): batch and tokens over
  `("node", "expert")`, experts over `("node", "expert")`: moe_ffn's expert_axis is the tuple,
  `node` the outer axis of its hierarchical ring and `expert` the inner one. `node` without
  `expert` is folded like any other axis.
- folded `("data", "context")` (docs/sharding.md, "Parallel folding"): attention sees batch over
  `data` and seq over `context` (context parallelism: keys and values are all-gathered over
  `context`); the MoE sees tokens over `("data", "context")` and runs its ring over
  `expert_axis=("data", "context")`: the two axes act as one expert axis over the same devices.

Any name can be overridden: `rules_for(mesh, heads=("tensor",))`; layouts other than the four
above are not tested. Activations whose dimension does not divide by an axis' size drop that axis
(e.g. batch 2 on 8 devices is replicated for attention; the MoE then reshards its flattened tokens
over `tokens`); parameters must divide (`ModelConfig.check_mesh`).

With `ModelConfig.scan_layers` every decoder-layer parameter has one more, leading dimension named
`layers` (e.g. w_gate is ("layers", "experts", "embed", "expert_ffn")). The rules never shard it
(`rules_for` refuses an override): `jax.lax.scan` slices one layer per step, which must be local to
every device, so each device holds its share of every layer as before. (The trainer's *storage*
over `fsdp` and `context`, `train.step.storage.stored_sharding`, treats it like any other
dimension: it is chosen when it is a parameter's largest free one, e.g. q_norm [48, 16]; the step
gathers every parameter back to these rules before the forward.)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.op.layout import is_explicit, spec_entry

LOGICAL = (
    "batch",
    "seq",
    "tokens",
    "experts",
    "expert_ffn",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "vocab",
    "router",
    "layers",
)
LAYERS = "layers"  # the leading axis of the stacked (scanned) decoder-layer parameters


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """The mapping logical name -> tuple of mesh axes (empty: replicated), for one mesh."""

    mesh: jax.sharding.Mesh
    table: tuple[tuple[str, tuple[str, ...]], ...]

    def axes(self, name: str | None) -> tuple[str, ...]:
        if name is None:
            return ()
        for k, v in self.table:
            if k == name:
                return v
        raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL}")

    def spec(self, *names: str | None) -> P:
        """PartitionSpec of an array whose dims carry these logical names."""
        return P(*(spec_entry(a) for a in self._distinct(names, [self.axes(n) for n in names])))

    def _distinct(self, names, axes):
        """`axes` (one tuple per dim), refused when a mesh axis shards two dims of one array."""
        seen = {}
        for n, dim_axes in zip(names, axes):
            for a in dim_axes:
                if a in seen:
                    raise ValueError(
                        f"AxisRules: mesh axis {a!r} is mapped to both {seen[a]!r} and {n!r}, "
                        f"two dimensions of one array (logical axes {tuple(names)}); a mesh "
                        f"axis shards at most one dimension: map them to different axes "
                        f"(rules_for(mesh, {n}=...))"
                    )
                seen[a] = n
        return axes

    def check_divides(self, shape, names, what: str) -> None:
        """Refuse a parameter `what` whose dims do not divide by their mesh axes' sizes."""
        for d, n in zip(shape, names):
            size = self.size(n) if n is not None else 1
            if d % size:
                raise ValueError(
                    f"{what}: dimension {n!r} of size {d} does not divide over the {size} "
                    f"devices of its mesh axes {self.axes(n)} (shape {tuple(shape)}, logical "
                    f"axes {tuple(names)})"
                )

    def sharding(self, *names: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*names))

    def fit(self, shape, *names: str | None) -> P:
        """Like `spec`, but each dim keeps only the leading axes whose sizes divide it; a dim of
        size one is never sharded (over axes of size one it would change nothing but its type,
        `[1@expert, ...]`, which some of jax's transposes drop: a batch of one on one device)."""
        out = []
        for n, d in zip(names, shape):
            kept, size = [], 1
            for a in self.axes(n):
                if d == 1 or d % (size * self.mesh.shape[a]):
                    break
                kept.append(a)
                size *= self.mesh.shape[a]
            out.append(tuple(kept))
        return P(*map(spec_entry, self._distinct(names, out)))

    def size(self, name: str) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes(name))

    # what `moe_ffn` needs
    @property
    def expert_axis(self) -> str | tuple[str, ...]:
        ea = self.axes("experts")
        return ea[0] if len(ea) == 1 else ea

    @property
    def expert_tensor_axis(self) -> str | None:
        etp = self.axes("expert_ffn")
        if len(etp) > 1:
            raise ValueError(f"expert_ffn maps to {etp}: moe_ffn takes one expert_tensor_axis")
        return etp[0] if etp else None

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.axes("tokens")


def rules_for(mesh: jax.sharding.Mesh, **overrides: tuple[str, ...] | str | None) -> AxisRules:
    """The default rules for `mesh` (see the module docstring), with `overrides` by name."""
    names = tuple(mesh.axis_names)
    batch = tuple(a for a in names if a in ("data", "fsdp", "node", "expert"))
    seq = tuple(a for a in names if a == "context")
    if "expert" in names:  # "node", if present, is the outer (inter-host) expert axis
        experts = ("node", "expert") if "node" in names else ("expert",)
    else:  # parallel folding: the attention axes taken together as one expert axis
        experts = tuple(a for a in names if a not in ("tensor", "expert_tensor"))
    table = {n: () for n in LOGICAL}
    table.update(
        batch=batch,
        seq=seq,
        tokens=batch + seq,
        experts=experts,
        expert_ffn=tuple(a for a in names if a == "expert_tensor"),
    )
    for k, v in overrides.items():
        if k not in table:
            raise ValueError(f"rules_for: unknown logical axis {k!r}; known: {LOGICAL}")
        v = () if v is None else (v,) if isinstance(v, str) else tuple(v)
        bad = [a for a in v if a not in names]
        if bad:
            raise ValueError(f"rules_for({k}={v}): {bad} not axes of the mesh {names}")
        if k == LAYERS and v:
            raise ValueError(
                f"rules_for({k}={v}): the stacked layer axis is never sharded "
                "(the layer scan slices one layer per step)"
            )
        table[k] = v
    _check_moe_axes(table, mesh)
    return AxisRules(mesh, tuple(table.items()))


def _check_moe_axes(table, mesh) -> None:
    """The rules the MoE weights and `moe_ffn` need: experts, embed and expert_ffn on distinct
    mesh axes, one expert_ffn axis at most, and the tokens over every expert axis."""
    w = ("experts", "embed", "expert_ffn")
    for i, a in enumerate(w):
        for b in w[i + 1 :]:
            both = [x for x in table[a] if x in table[b]]
            if both:
                raise ValueError(
                    f"rules_for: {a}={table[a]} and {b}={table[b]} share the mesh axis "
                    f"{both[0]!r}, but they are two dimensions of the expert weights "
                    f"[E, H, F] (experts, embed, expert_ffn), which one mesh axis cannot "
                    f"shard twice; map {b} to another axis or to None"
                )
    if len(table["expert_ffn"]) > 1:
        raise ValueError(
            f"rules_for: expert_ffn={table['expert_ffn']}: expected one mesh axis at most "
            "(moe_ffn takes one expert_tensor_axis)"
        )
    experts, tokens = table["experts"], table["tokens"]
    missing = tuple(a for a in experts if a not in tokens)
    if not missing:
        return
    kept = tuple(a for a in experts if a in tokens)
    fold = f"rules_for(mesh, tokens={tokens + missing}) to run the experts over all of {experts}"
    if kept and len(missing) == 1 and not table["expert_ffn"]:
        fix = (
            f"e.g. rules=rules_for(mesh, experts={spec_entry(kept)!r}, "
            f"expert_ffn={missing[0]!r}) (experts over {spec_entry(kept)!r}, each expert's ffn "
            f"split over {missing[0]!r}), or {fold}"
        )
    elif tokens:
        fix = f"e.g. rules=rules_for(mesh, experts=...) with axes among {tokens}, or {fold}"
    else:
        fix = f"e.g. rules={fold.replace(' to run', ', to run')}"
    axes = ", ".join(f"{a!r}: {n}" for a, n in mesh.shape.items())
    raise ValueError(
        f"rules_for(mesh {{{axes}}}): the experts would be sharded over {experts} but the "
        f"tokens only over {tokens}, and moe_ffn needs the tokens over every expert axis; "
        f"say which mesh axes hold the experts and pass the rules to MoELayer / QwenMoe: {fix} "
        "(docs/model.md, Sharding rules)"
    )


def constrain(x, mesh, spec: P):
    """Put `x` on `spec`: `reshard` on an Explicit mesh, a sharding constraint on an Auto one."""
    sharding = NamedSharding(mesh, spec)
    if is_explicit(mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _reshape(x, shape, mesh, spec: P):
    """Reshape, telling an Explicit mesh the result's sharding (an Auto mesh infers it)."""
    out = NamedSharding(mesh, spec) if is_explicit(mesh) else None
    return jnp.reshape(x, shape, out_sharding=out)


def token_layout(rules: AxisRules, b: int, s: int):
    """The axes batch and seq keep for a [b, s] activation, and how many shards each has."""
    spec = rules.fit((b, s), "batch", "seq")
    ba, sa = (() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)
    nb = math.prod(rules.mesh.shape[a] for a in ba)
    ns = math.prod(rules.mesh.shape[a] for a in sa)
    return ba, sa, nb, ns


def to_tokens(x_bs, rules: AxisRules):
    """[B, S, ...] -> [B*S, ...] sharded over the `tokens` axes, for the MoE.

    The flattening order is device-major: with B split in `nb` shards and S in `ns`, the tokens of
    shard (i, j) form the (i*ns + j)-th contiguous block, so flattening moves no data (a plain
    row-major flatten would, whenever a device holds part of more than one sequence). The MoE is
    per token, so the order does not matter; `from_tokens` inverts it. The tokens are then
    resharded over `tokens` (a no-op when the kept batch and seq axes are the token axes).
    """
    b, s, *rest = x_bs.shape
    ba, sa, nb, ns = token_layout(rules, b, s)
    mesh, more = rules.mesh, [None] * len(rest)
    x = constrain(x_bs, mesh, P(spec_entry(ba), spec_entry(sa), *more))
    if ns > 1:  # [nb, b/nb, ns, s/ns] -> [nb, ns, b/nb, s/ns]: shard-major
        x = _reshape(
            x,
            (nb, b // nb, ns, s // ns, *rest),
            mesh,
            P(spec_entry(ba), None, spec_entry(sa), None, *more),
        )
        x = jnp.swapaxes(x, 1, 2)
    x = _reshape(x, (b * s, *rest), mesh, P(spec_entry(ba + sa), *more))
    return constrain(x, mesh, P(spec_entry(rules.token_axes), *more))


def from_tokens(y_t, b: int, s: int, rules: AxisRules):
    """The inverse of `to_tokens`: [B*S, ...] -> [B, S, ...] on its (batch, seq) sharding."""
    _, *rest = y_t.shape
    ba, sa, nb, ns = token_layout(rules, b, s)
    mesh, more = rules.mesh, [None] * len(rest)
    y = constrain(y_t, mesh, P(spec_entry(ba + sa), *more))
    if ns > 1:
        y = _reshape(
            y,
            (nb, ns, b // nb, s // ns, *rest),
            mesh,
            P(spec_entry(ba), spec_entry(sa), None, None, *more),
        )
        y = jnp.swapaxes(y, 1, 2)
    return _reshape(y, (b, s, *rest), mesh, P(spec_entry(ba), spec_entry(sa), *more))
