"""Collective-permute and all-to-all traffic read from a compiled XLA program's HLO text.

Pass ``jax.jit(f).lower(*args).compile().as_text()``. Counted, per device:

* every ``collective-permute`` (sync) and every ``collective-permute-start`` (async); the matching
  ``-done`` is skipped, so each transfer counts once; likewise ``all-to-all`` and
  ``all-to-all-start``;
* its bytes are the sizes of its operands as compiled (tuple shapes summed, layouts ignored). That
  is the wire dtype, which can differ from the traced one: XLA:CPU, for one, sends bf16 as f32;
* its ``trips`` is the product of the ``known_trip_count`` of every while loop around it, following
  the call graph (while bodies and conditions, fusions, calls, conditional branches, async
  wrappers). A loop with no known trip count counts once, a conditional branch as if taken, and a
  computation called from several sites sums over them.

A ``lax.ppermute`` of a pytree lowers to one op per leaf, which XLA may or may not combine.

Which device sends where: the ops name devices by partition id, and in an SPMD program partition
``i`` is ``mesh.devices.flat[i]`` (tests/test_hlo.py checks it on a compiled program's device
assignment). `link_bytes` and `all_to_all_link_bytes` split each device's bytes into those sent to
another device of its host and those sent to another host, given the host of every partition
(`host_of(mesh)`).
"""

import dataclasses
import math
import re

import numpy as np

# public: overlap.py reads computations and trip counts with the same patterns
COMP = re.compile(r"^(?:ENTRY )?%(\S+) ")  # a computation's header: its name
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')  # a while loop's known trip count
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(([^)]*)\)(.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%[^\s,]+)"
)
_BITS = {"pred": 8, "token": 0}
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(
    r"replica_groups=(\{\}|\{\{[\d,{}]*\}\}"  # {} (all), {{0,1},{2,3}}
    r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"  # iota: [2,4]<=[4,2]T(1,0)
    r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\))? \{[^}]*\})"  # mesh['a'=2,'b'=4] {'b'}
)


@dataclasses.dataclass(frozen=True)
class Permute:
    computation: str  # HLO computation holding the op (e.g. a while body)
    name: str  # instruction name
    bytes: int  # bytes one device sends: the op's operand sizes, summed
    trips: int  # runs per program execution: product of enclosing known loop trip counts
    pairs: tuple[tuple[int, int], ...] = ()  # (source, target) partition ids


@dataclasses.dataclass(frozen=True)
class AllToAll:
    """One all-to-all. A device passes in `bytes` and sends `member_bytes[j]` of it to the j-th
    member of its replica group, itself included: XLA splits the array form's operand into
    group-size equal slices along its split dimension (slice j to member j), and the tuple form
    sends its j-th operand to member j."""

    computation: str
    name: str
    bytes: int  # bytes one device passes in: the operand sizes, summed
    trips: int
    groups: tuple[tuple[int, ...], ...]  # replica groups of partition ids
    member_bytes: tuple[int, ...]  # bytes to the j-th member of the group


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string such as ``f32[16,128]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS[dtype] if dtype in _BITS else int(re.match(r"[a-z]+(\d+)", dtype)[1])
        total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * bits / 8)
    return total


def _collectives(hlo_text: str, opcodes):
    """[(computation, name, operand bytes per operand, attributes, trips)] of every op with one
    of `opcodes`, in text order."""
    shapes: dict[str, str] = {}
    found: list[tuple[str, str, list[str], str]] = []  # (computation, name, operands, attrs)
    calls: list[tuple[str, str, int]] = []  # (caller, callee, trips per call)
    comp = ""
    for line in hlo_text.splitlines():
        if (m := COMP.match(line)) and line.rstrip().endswith("{"):
            comp = m.group(1)
        elif m := _INSTR.match(line):
            name, shape, opcode, operands, attrs = m.groups()
            shapes[name] = shape
            if opcode in opcodes:
                found.append((comp, name, re.findall(r"%([^\s,]+)", operands), attrs))
            for kind, callees in _CALLEE.findall(attrs):
                n = TRIPS.search(attrs) if kind == "body" else None
                for callee in re.findall(r"%([^\s,}]+)", callees):
                    calls.append((comp, callee, int(n.group(1)) if n else 1))
    # HLO text lists callees before callers, so the last computation is the entry and walking
    # call sites backwards settles every caller before its callees.
    trips = {comp: 1}
    for caller, callee, n in reversed(calls):
        trips[callee] = trips.get(callee, 0) + trips.get(caller, 0) * n
    return [
        (c, name, [shape_bytes(shapes[o]) for o in ops], attrs, trips.get(c, 0))
        for c, name, ops, attrs in found
    ]


def collective_permutes(hlo_text: str) -> list[Permute]:
    """Every collective permute in the module, in text order."""
    out = []
    for c, name, sizes, attrs, trips in _collectives(
        hlo_text, ("collective-permute", "collective-permute-start")
    ):
        out.append(Permute(c, name, sum(sizes), trips, source_target_pairs(attrs)))
    return out


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    """The (source, target) partition ids of a collective permute's attribute text."""
    m = _PAIRS.search(attrs)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m[1])) if m else ()


def loop_permute_bytes(hlo_text: str) -> list[int]:
    """Per while body holding permutes directly: bytes of one iteration (one ring hop)."""
    bodies = set(re.findall(r"\bwhile\(.*?\bbody=%([^\s,]+)", hlo_text))
    per_body: dict[str, int] = {}
    for p in collective_permutes(hlo_text):
        if p.computation in bodies:
            per_body[p.computation] = per_body.get(p.computation, 0) + p.bytes
    return list(per_body.values())


def total_permute_bytes(hlo_text: str) -> int:
    """Bytes one device sends by collective permute over one program execution."""
    return sum(p.bytes * p.trips for p in collective_permutes(hlo_text))


@dataclasses.dataclass(frozen=True)
class LoopSchedule:
    """The order of one while body's async permutes around the while loops it runs.

    Positions are instruction indices in the body's scheduled order (`as_text()` of a compiled,
    scheduled module prints each computation in its schedule's order).
    """

    computation: str  # the while body
    starts: tuple[int, ...]  # positions of its collective-permute-starts
    dones: tuple[int, ...]  # positions of their -dones
    loops: tuple[int, ...]  # positions of the while loops it runs (a ring hop's chunk loop)

    @property
    def overlapped(self) -> bool:
        """Every transfer starts before the body's first loop and ends after its last one."""
        return bool(self.loops and self.starts) and (
            max(self.starts) < min(self.loops) and min(self.dones) > max(self.loops)
        )


def loop_schedules(hlo_text: str) -> list[LoopSchedule]:
    """Every while body that issues async collective permutes, with their order around its loops.

    A ring loop body hides its transfer behind its hop's compute when `overlapped` holds: the
    permute starts before the chunk loop and is waited for after it. A synchronous
    `collective-permute` (XLA:CPU) has no start/done pair and is not listed.
    """
    bodies = set(re.findall(r"\bwhile\(.*?\bbody=%([^\s,]+)", hlo_text))
    order: dict[str, list[tuple[str, str, str]]] = {}  # computation -> (name, opcode, operands)
    comp = ""
    for line in hlo_text.splitlines():
        if (m := COMP.match(line)) and line.rstrip().endswith("{"):
            comp = m.group(1)
        elif (m := _INSTR.match(line)) and comp in bodies:
            name, _, opcode, operands, _ = m.groups()
            order.setdefault(comp, []).append((name, opcode, operands))
    out = []
    for comp, instrs in order.items():
        pos = {name: i for i, (name, _, _) in enumerate(instrs)}
        starts = [i for i, (_, op, _) in enumerate(instrs) if op == "collective-permute-start"]
        if not starts:
            continue
        start_names = {instrs[i][0] for i in starts}
        dones = [
            i
            for i, (_, op, ops) in enumerate(instrs)
            if op == "collective-permute-done" and re.findall(r"%([^\s,]+)", ops)[0] in start_names
        ]
        loops = [pos[name] for name, op, _ in instrs if op == "while"]
        out.append(LoopSchedule(comp, tuple(starts), tuple(dones), tuple(loops)))
    return out


# ------------------------------------------------------------------ all-to-all and links

_NUM_PARTITIONS = re.compile(r"^HloModule .*?\bnum_partitions=(\d+)", re.M)


def replica_groups(text: str, num_partitions: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The partition-id groups of an HLO ``replica_groups=`` value, in any of XLA's spellings:
    ``{{0,1},{2,3}}``, ``{}`` (one group of all `num_partitions`), iota ``[2,4]<=[4,2]T(1,0)``,
    or mesh axes ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'a':(1)2``, ``device_ids=(...)``)."""
    ints = lambda s: [int(i) for i in re.findall(r"\d+", s)]
    if text == "{}":
        if num_partitions is None:
            raise ValueError("replica_groups={} means all partitions: pass num_partitions")
        return (tuple(range(num_partitions)),)
    if text.startswith("{"):
        return tuple(tuple(ints(g)) for g in re.findall(r"\{([\d,]*)\}", text[1:-1]))
    if m := re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        dims = ints(m[2])
        perm = ints(m[3]) if m[3] else range(len(dims))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(list(perm))
        return tuple(map(tuple, ids.reshape(-1, ints(m[1])[-1]).tolist()))
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:, device_ids=\(([^)]*)\))? \{([^}]*)\}", text)
    if not m:
        raise ValueError(f"unknown replica_groups spelling: {text!r}")
    axes = re.findall(r"'?([^'=,]+)'?=(\d+)", m[1])
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = np.array(ints(m[2]) if m[2] else range(math.prod(sizes))).reshape(sizes)
    refs = []  # (mesh axis, pre-size, size) of each grouped axis, in the listed order
    for ref in filter(None, m[3].split(",")):
        a = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref.strip())
        axis = names.index(a[1])
        refs.append((axis, int(a[2]), int(a[3])) if a[2] else (axis, 1, sizes[axis]))
    # As XLA does: split each mesh axis into its sub-axes (pre-size = the product of the
    # factors before it, major first), then move the grouped factors last, in the listed order.
    dims, grouped = [], [0] * len(refs)
    for axis, full in enumerate(sizes):
        prefix = 1
        for r in sorted(
            (r for r in range(len(refs)) if refs[r][0] == axis), key=lambda r: refs[r][1]
        ):
            _, pre, size = refs[r]
            if pre != prefix:
                dims.append(pre // prefix)
            grouped[r], prefix = len(dims), pre * size
            dims.append(size)
        if prefix != full:
            dims.append(full // prefix)
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    size = math.prod(dims[d] for d in grouped)
    return tuple(map(tuple, ids.reshape(dims).transpose(order).reshape(-1, size).tolist()))


def all_to_alls(hlo_text: str) -> list[AllToAll]:
    """Every all-to-all (sync, or the async start) in the module, in text order."""
    m = _NUM_PARTITIONS.search(hlo_text)
    num_partitions = int(m[1]) if m else None
    out = []
    for c, name, sizes, attrs, trips in _collectives(hlo_text, ("all-to-all", "all-to-all-start")):
        g = _GROUPS.search(attrs)
        groups = replica_groups(g[1] if g else "{}", num_partitions)
        n = len(groups[0])
        member = tuple(sizes) if len(sizes) > 1 else (sizes[0] // n,) * n
        out.append(AllToAll(c, name, sum(sizes), trips, groups, member))
    return out


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes each device sends over one program execution (loop trips counted), by where they go:
    `intra[i]` from partition i to other devices of its host, `inter[i]` to devices of other
    hosts. What a device sends itself (a self pair, its own all-to-all slice) crosses no link
    and is not counted."""

    intra: tuple[int, ...]
    inter: tuple[int, ...]

    @property
    def max_intra(self) -> int:
        return max(self.intra, default=0)

    @property
    def max_inter(self) -> int:
        return max(self.inter, default=0)

    def __add__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(
            tuple(map(sum, zip(self.intra, other.intra))),
            tuple(map(sum, zip(self.inter, other.inter))),
        )


def host_of(mesh) -> tuple[int, ...]:
    """The host (`process_index`) of each partition id: of `mesh.devices.flat`, in order."""
    return tuple(d.process_index for d in mesh.devices.flat)


def _split(sends, host_of) -> LinkBytes:
    """`sends`: (source, target, bytes) partition-id triples."""
    intra, inter = [0] * len(host_of), [0] * len(host_of)
    for src, dst, nbytes in sends:
        if max(src, dst) >= len(host_of):
            raise ValueError(
                f"partition {max(src, dst)} has no host: host_of has {len(host_of)} entries"
            )
        if src != dst:
            (intra if host_of[src] == host_of[dst] else inter)[src] += nbytes
    return LinkBytes(tuple(intra), tuple(inter))


def link_bytes(hlo_text: str, host_of) -> LinkBytes:
    """Collective-permute bytes per device over one program execution (as `total_permute_bytes`,
    trips-weighted), split into same-host and cross-host. `host_of[i]`: partition i's host."""
    return _split(
        ((s, t, p.bytes * p.trips) for p in collective_permutes(hlo_text) for s, t in p.pairs),
        host_of,
    )


def all_to_all_link_bytes(hlo_text: str, host_of) -> LinkBytes:
    """All-to-all bytes per device over one program execution, split as `link_bytes`: each device
    sends `member_bytes[j]` to the j-th member of its group."""
    return _split(
        (
            (s, t, b * a.trips)
            for a in all_to_alls(hlo_text)
            for g in a.groups
            for s in g
            for t, b in zip(g, a.member_bytes)
        ),
        host_of,
    )
