"""What a scheduled XLA program hides its cross-host transfers behind, read from its HLO text.

Pass `compiled.as_text()` of a program compiled for a multi-host mesh (e.g. the abstract GPUs of
`relaymoe_jax.gpu_mesh`, where each device has its host's process index). `as_text()` prints each
computation of a scheduled module in schedule order. For every collective permute that sends to
another host (a synchronous one brackets nothing), `cross_host_transfers` returns where its start
and done sit in its computation and how many ring hops of compute run between them (`hops`),
against how many it could run beside (`free`): hop loops of the same computation that neither
feed it nor depend on it.

A hop is one while loop of a ring hop's chunks (`jax.named_scope("ring_fwd_hop" / "ring_bwd_hop")`
in `dispatch/hop.py`); a loop holding hop loops (an inner ring) counts them times its known trip
count, and a conditional its largest branch.
"""

import dataclasses
import re

from relaymoe_jax.analysis import hlo
from relaymoe_jax.analysis.hlo import COMP, TRIPS

# hlo's instruction pattern with a lazy operand list and the attributes optional: conditionals'
# and calls' operands here are read back by name
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*?)\)(, .*)?$")
_BODY = re.compile(r"\bbody=%([^\s,]+)")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%([^\s,]+)")
_BRANCHES = re.compile(
    r"\b(?:true_computation|false_computation)=%([^\s,]+)|"
    r"branch_computations=\{([^}]*)\}"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAMES = re.compile(r"%([^\s,()]+)")
HOP_SCOPES = ("ring_fwd_hop", "ring_bwd_hop")


@dataclasses.dataclass(frozen=True)
class Transfer:
    computation: str  # the computation holding the start and done
    name: str  # the collective-permute-start
    start: int  # its position in the computation's schedule
    done: int  # the position of its collective-permute-done
    hops: int  # ring hops of compute scheduled between them
    free: int  # hops of the computation independent of it (could run beside it)
    bytes: int  # bytes one device sends
    pairs: tuple  # its (source, target) partition ids that cross hosts
    op_name: str  # jax's name for it (metadata)


def _parse(text):
    comps: dict[str, list[tuple[str, str, str, str, str]]] = {}
    comp = ""
    for line in text.splitlines():
        if (m := COMP.match(line)) and line.rstrip().endswith("{"):
            comp = m.group(1)
            comps[comp] = []
        elif m := _INSTR.match(line):
            name, shape, opcode, operands, attrs = m.groups()
            comps.setdefault(comp, []).append((name, shape, opcode, operands, attrs or ""))
    return comps


class _Hops:
    """Hops of compute one instruction runs."""

    def __init__(self, comps):
        self.comps, self.memo = comps, {}

    def comp(self, name):
        if name not in self.memo:
            self.memo[name] = 0
            self.memo[name] = sum(self.instr(i) for i in self.comps.get(name, ()))
        return self.memo[name]

    def instr(self, instr):
        _, _, opcode, _, attrs = instr
        if opcode == "while":
            op = _OP_NAME.search(attrs)
            if op and op[1].split("/")[-2:-1] and op[1].split("/")[-2] in HOP_SCOPES:
                return 1
            trips, body = TRIPS.search(attrs), _BODY.search(attrs)
            return (int(trips[1]) if trips else 1) * (self.comp(body[1]) if body else 0)
        if opcode == "conditional":
            branches = [
                b for a, bs in _BRANCHES.findall(attrs) for b in ([a] if a else _NAMES.findall(bs))
            ]
            return max((self.comp(b) for b in branches), default=0)
        return sum(self.comp(c) for c in _CALLS.findall(attrs))


def cross_host_transfers(hlo_text: str, host_of) -> list[Transfer]:
    """Every async collective permute with a source-target pair between two hosts (`host_of`:
    the host of each partition id, `hlo.host_of(mesh)`), with the hops it brackets."""
    comps = _parse(hlo_text)
    hops = _Hops(comps)
    out = []
    for comp, instrs in comps.items():
        pos = {ins[0]: i for i, ins in enumerate(instrs)}
        operands = [[pos[o] for o in _NAMES.findall(ins[3]) if o in pos] for ins in instrs]
        users = [[] for _ in instrs]
        for i, ops in enumerate(operands):
            for o in ops:
                users[o].append(i)

        def closure(i, edges):
            seen, todo = set(), [i]
            while todo:
                for j in edges[todo.pop()]:
                    if j not in seen:
                        seen.add(j)
                        todo.append(j)
            return seen

        for i, (name, _, opcode, _, attrs) in enumerate(instrs):
            if opcode not in ("collective-permute-start", "collective-permute"):
                continue
            pairs = hlo.source_target_pairs(attrs)
            cross = tuple((s, t) for s, t in pairs if host_of[s] != host_of[t])
            if not cross:
                continue
            done = (
                i
                if opcode == "collective-permute"
                else next(j for j in users[i] if instrs[j][2] == "collective-permute-done")
            )
            tied = closure(i, operands) | closure(done, users)
            free = sum(hops.instr(ins) for j, ins in enumerate(instrs) if j not in tied)
            nbytes = sum(hlo.shape_bytes(instrs[o][1]) for o in operands[i])
            op = _OP_NAME.search(attrs)
            out.append(
                Transfer(
                    comp,
                    name,
                    i,
                    done,
                    sum(hops.instr(ins) for ins in instrs[i + 1 : done]),
                    free,
                    nbytes,
                    cross,
                    op[1] if op else "",
                )
            )
    return out
