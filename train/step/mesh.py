"""The trainer's device mesh, from the `mesh` option: `"data=2,expert=4"`.

Axes (any subset, in this order in the mesh): `data` (data parallel), `fsdp` (data parallel with
parameters and optimizer state stored sharded, see `storage.stored_sharding`), `node` (the
outer expert-parallel axis: across hosts), `expert` (the ring; with `node`, the inner, intra-host
part of it), `context` (sequence sharding for attention; the train state is stored sharded over it
too, as over `fsdp`), `expert_tensor` (each expert's ffn split, ETP). One size may be `-1`: all
devices left. The default `"expert=-1"` is EP over every device. Without an `expert` axis the MoE
ring runs over all the other axes taken together (parallel folding,
`relaymoe_jax.models.sharding.rules_for`).

`node` (docs/multinode.md, "Expert parallelism across nodes"): the experts are sharded over
`("node", "expert")` (EP = node x expert) and the tokens over every axis but `expert_tensor` as
before. It needs an `expert` axis (refused otherwise: `node` alone would only be another name
for folding). `jax.make_mesh` lays GPUs out host-major (sorted by device id, process by process),
so with H hosts of 8 GPUs `mesh=node=H,expert=8` puts one host on each `node` index and keeps
each host's 8 GPUs on `expert`; with one process per host the model's `ring="auto"` then runs
the hierarchical ring (an inner ring over `expert`, one inter-node transfer per round over
`node`; auto reads the hosts from `process_index`). A `node` axis that does
not follow the hosts (e.g. on one host, or `expert` wider than a host) is legal; `ring="auto"`
then runs the flat ring over both axes together (`relaymoe_jax.op.topology` decides; the planner's
header says which).
"""

import math

import jax

from relaymoe_jax.kernels.attention import interpret as interpreter

AXES = ("data", "fsdp", "node", "expert", "context", "expert_tensor")


def parse_mesh(spec: str, n_devices: int) -> dict[str, int]:
    """`"data=2,expert=-1"` -> {"data": 2, "expert": n_devices // 2}, checked against the device
    count. ValueError naming the spec for anything malformed."""
    sizes: dict[str, int] = {}
    for item in (s.strip() for s in str(spec).split(",")):
        name, eq, val = item.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise ValueError(
                f"mesh={spec!r}: items are axis=size with axis one of {AXES}; got {item!r}"
            )
        if name in sizes:
            raise ValueError(f"mesh={spec!r}: axis {name!r} given twice")
        try:
            sizes[name] = int(val)
        except ValueError:
            raise ValueError(
                f"mesh={spec!r}: size of {name!r} must be an integer, got {val!r}"
            ) from None
        if sizes[name] < 1 and sizes[name] != -1:
            raise ValueError(f"mesh={spec!r}: size of {name!r} must be >= 1 or -1, got {val}")
    if "node" in sizes and "expert" not in sizes:
        raise ValueError(
            f"mesh={spec!r}: axis 'node' is the outer expert axis and needs an "
            f"'expert' axis too (the intra-node ring): "
            f"mesh=node=<hosts>,expert=<GPUs per host>, e.g. node=2,expert=8"
        )
    rest = [a for a, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh={spec!r}: at most one axis may be -1, got {rest}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if n_devices % known:
            raise ValueError(f"mesh={spec!r}: {n_devices} devices do not divide by {known}")
        sizes[rest[0]] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(
            f"mesh={spec!r} has {math.prod(sizes.values())} devices but "
            f"{n_devices} are available (jax.device_count())"
        )
    return {a: sizes[a] for a in AXES if a in sizes}


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """An Explicit mesh over all (global) devices with the axes of `spec`."""
    sizes = parse_mesh(spec, jax.device_count())
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes))


def expert_axes(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes the experts are split over (`rules_for`'s "experts"): ("node", "expert"),
    ("expert",), or (folding) every axis but `expert_tensor`."""
    if "expert" in sizes:
        return ("node", "expert") if "node" in sizes else ("expert",)
    return tuple(a for a in sizes if a != "expert_tensor")


def expert_size(sizes: dict[str, int]) -> int:
    """Devices the experts are split over: the `node` and `expert` axes, or (folding) every
    axis but `expert_tensor`."""
    return math.prod(sizes[a] for a in expert_axes(sizes))


DATA_AXES = ("data", "fsdp", "node")  # the axes that split a batch's rows, whatever the model


def check(
    sizes: dict[str, int], cfg, batch_size: int, seq_len: int, spec: str, platform: str
) -> None:
    """The config and batch fit the mesh (ValueError naming the values otherwise); `platform`:
    what the step compiles for ("gpu" for a deviceless GPU mesh, else the devices')."""
    if cfg.attention_impl == "pallas" and platform != "gpu":  # jax's error named nothing
        raise ValueError(
            f"attention_impl='pallas' compiles a Mosaic GPU kernel, but this run compiles for "
            f"{platform!r}: use attention_impl='pallas-interpret' (the same kernel in its "
            "interpreter, slow: for tests), 'chunked' or 'auto'"
        )
    etp = sizes.get("expert_tensor", 1)
    if cfg.moe.moe_intermediate_size % etp:
        raise ValueError(
            f"mesh={spec!r}: moe_intermediate_size={cfg.moe.moe_intermediate_size} "
            f"does not split over expert_tensor={etp}"
        )
    opts = cfg.moe.options
    if opts.dispatcher == "ring" and opts.ring == "hierarchical" and len(expert_axes(sizes)) < 2:
        raise ValueError(
            f"mesh={spec!r}: ring='hierarchical' needs the experts over two axes, "
            f"e.g. mesh=node=<hosts>,expert=<GPUs per host>; this mesh has "
            f"{expert_axes(sizes)}"
        )
    if cfg.attention_impl == interpreter.IMPL:  # before anything is built or compiled
        interpreter.check_devices(math.prod(sizes.values()), f"mesh={spec!r}")
        interpreter.check_threads()
    rows = math.prod(sizes.get(a, 1) for a in DATA_AXES)
    if batch_size % rows:
        over = ", ".join(f"{a}={sizes[a]}" for a in DATA_AXES if a in sizes)
        raise ValueError(
            f"mesh={spec!r}: batch_size={batch_size} does not split over {over} (each takes a "
            f"share of a batch's rows; a batch that does not split would run replicated): use a "
            f"multiple of {rows}"
        )
    ctx = sizes.get("context", 1)
    if seq_len % ctx:
        raise ValueError(f"mesh={spec!r}: seq_len={seq_len} does not split over context={ctx}")
    tokens = batch_size * seq_len
    token_shards = math.prod(s for a, s in sizes.items() if a != "expert_tensor")
    if tokens % token_shards:
        raise ValueError(
            f"mesh={spec!r}: batch_size*seq_len={tokens} tokens do not split over "
            f"the {token_shards} token shards"
        )
