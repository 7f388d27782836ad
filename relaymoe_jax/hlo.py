"""Collective-permute traffic read from a compiled XLA program's HLO text.

Pass ``jax.jit(f).lower(*args).compile().as_text()``. Counted, per device:

* every ``collective-permute`` (sync) and every ``collective-permute-start`` (async); the matching
  ``-done`` is skipped, so each transfer counts once;
* its bytes are the sizes of its operands as compiled (tuple shapes summed, layouts ignored). That
  is the wire dtype, which can differ from the traced one: XLA:CPU, for one, sends bf16 as f32;
* its ``trips`` is the product of the ``known_trip_count`` of every while loop around it, following
  the call graph (while bodies and conditions, fusions, calls, conditional branches, async
  wrappers). A loop with no known trip count counts once, a conditional branch as if taken, and a
  computation called from several sites sums over them.

A ``lax.ppermute`` of a pytree lowers to one op per leaf, which XLA may or may not combine.
"""

import dataclasses
import math
import re

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(([^)]*)\)(.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%[^\s,]+)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BITS = {"pred": 8, "token": 0}


@dataclasses.dataclass(frozen=True)
class Permute:
    computation: str  # HLO computation holding the op (e.g. a while body)
    name: str  # instruction name
    bytes: int  # bytes one device sends: the op's operand sizes, summed
    trips: int  # runs per program execution: product of enclosing known loop trip counts


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string such as ``f32[16,128]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS[dtype] if dtype in _BITS else int(re.match(r"[a-z]+(\d+)", dtype)[1])
        total += math.ceil(math.prod(int(d) for d in dims.split(",") if d) * bits / 8)
    return total


def collective_permutes(hlo_text: str) -> list[Permute]:
    """Every collective permute in the module, in text order."""
    shapes: dict[str, str] = {}
    found: list[tuple[str, str, list[str]]] = []  # (computation, name, operand names)
    calls: list[tuple[str, str, int]] = []  # (caller, callee, trips per call)
    comp = ""
    for line in hlo_text.splitlines():
        if (m := _COMP.match(line)) and line.rstrip().endswith("{"):
            comp = m.group(1)
        elif m := _INSTR.match(line):
            name, shape, opcode, operands, attrs = m.groups()
            shapes[name] = shape
            if opcode in ("collective-permute", "collective-permute-start"):
                found.append((comp, name, re.findall(r"%([^\s,]+)", operands)))
            for kind, callees in _CALLEE.findall(attrs):
                n = _TRIPS.search(attrs) if kind == "body" else None
                for callee in re.findall(r"%([^\s,}]+)", callees):
                    calls.append((comp, callee, int(n.group(1)) if n else 1))
    # HLO text lists callees before callers, so the last computation is the entry and walking
    # call sites backwards settles every caller before its callees.
    trips = {comp: 1}
    for caller, callee, n in reversed(calls):
        trips[callee] = trips.get(callee, 0) + trips.get(caller, 0) * n
    return [
        Permute(c, name, sum(shape_bytes(shapes[o]) for o in ops), trips.get(c, 0))
        for c, name, ops in found
    ]


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
    computation: str            # the while body
    starts: tuple[int, ...]     # positions of its collective-permute-starts
    dones: tuple[int, ...]      # positions of their -dones
    loops: tuple[int, ...]      # positions of the while loops it runs (a ring hop's chunk loop)

    @property
    def overlapped(self) -> bool:
        """Every transfer starts before the body's first loop and ends after its last one."""
        return bool(self.loops and self.starts) and (
            max(self.starts) < min(self.loops) and min(self.dones) > max(self.loops))


def loop_schedules(hlo_text: str) -> list[LoopSchedule]:
    """Every while body that issues async collective permutes, with their order around its loops.

    A ring loop body hides its transfer behind its hop's compute when `overlapped` holds: the
    permute starts before the chunk loop and is waited for after it. A synchronous
    `collective-permute` (XLA:CPU) has no start/done pair and is not listed.
    """
    bodies = set(re.findall(r"\bwhile\(.*?\bbody=%([^\s,]+)", hlo_text))
    order: dict[str, list[tuple[str, str, str]]] = {}   # computation -> (name, opcode, operands)
    comp = ""
    for line in hlo_text.splitlines():
        if (m := _COMP.match(line)) and line.rstrip().endswith("{"):
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
        dones = [i for i, (_, op, ops) in enumerate(instrs) if op == "collective-permute-done"
                 and re.findall(r"%([^\s,]+)", ops)[0] in start_names]
        loops = [pos[name] for name, op, _ in instrs if op == "while"]
        out.append(LoopSchedule(comp, tuple(starts), tuple(dones), tuple(loops)))
    return out
