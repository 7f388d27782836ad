"""The Triton kernels of a compiled XLA:GPU program, and the operand types they really receive.

A Pallas (Triton lowering) kernel appears in `compiled.as_text()` as a custom call to
`__gpu$xla.gpu.triton` whose `operand_layout_constraints={...}` list the types it is launched with,
after every conversion XLA kept (and `output_to_operand_aliasing` names an operand the output is
written into: an in-place accumulator). Those, not the traced dtypes, decide the kernel's math: a
16-bit kernel handed a float32 operand multiplies in f32 FMA, without the tensor cores
(`kernels/gmm/common.py`). `triton_calls` reads them; `wide_float_calls` lists the calls that take a
float operand wider than 16 bits.

The lowered Triton IR says the same from the other side: compiled with the XLA debug options
`xla_dump_to=DIR` and `xla_dump_emitter_re=.*` (they work deviceless), each kernel's pass pipeline
is dumped to `DIR/*.triton-to-llvm.txt`, and `tensor_core_kernels(DIR)` tells, per file, whether
its lowered code issues Hopper `wgmma` instructions.
"""

import dataclasses
import pathlib
import re

TRITON_TARGET = "__gpu$xla.gpu.triton"
_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_OPERANDS = re.compile(
    r"operand_layout_constraints=\{(.*?)\}, (?:output_to_operand_aliasing|api_version)"
)
_ALIASED = re.compile(r"output_to_operand_aliasing=\{(.*?)\}, api_version")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FLOAT_BITS = {"f64": 64, "f32": 32, "tf32": 32, "bf16": 16, "f16": 16}
WGMMA = "wgmma.mma_async"


@dataclasses.dataclass(frozen=True)
class TritonCall:
    name: str  # the HLO instruction
    operands: tuple[tuple[str, tuple[int, ...]], ...]  # (HLO element type, shape) per operand
    op_name: str  # the JAX source path (metadata op_name)
    aliased: tuple[int, ...] = ()  # operands the output is written into

    @property
    def kernel(self) -> str:
        """The Pallas kernel's name: the op_name component before `/pallas_call`."""
        parts = self.op_name.split("/")
        return parts[-2] if len(parts) > 1 and parts[-1] == "pallas_call" else self.op_name

    @property
    def wide_floats(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The operands of a float type wider than 16 bits (f32, f64) that the kernel multiplies:
        an operand aliased to the output (an in-place accumulator, `tgmm(acc=)`) is not one."""
        return tuple(
            o
            for i, o in enumerate(self.operands)
            if _FLOAT_BITS.get(o[0], 0) > 16 and i not in self.aliased
        )


def triton_calls(hlo_text: str) -> list[TritonCall]:
    """Every Triton custom call of a compiled program's HLO text, in program order."""
    calls = []
    for line in hlo_text.splitlines():
        if f'custom_call_target="{TRITON_TARGET}"' not in line:
            continue
        name, ops = _NAME.match(line), _OPERANDS.search(line)
        if name is None or ops is None:
            raise ValueError(f"a Triton custom call without operand types: {line[:200]}")
        operands = tuple(
            (t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(ops.group(1))
        )
        op_name, aliased = _OP_NAME.search(line), _ALIASED.search(line)
        calls.append(
            TritonCall(
                name.group(1),
                operands,
                op_name.group(1) if op_name else "",
                tuple(int(i) for i in re.findall(r"\((\d+),", aliased.group(1))) if aliased else (),
            )
        )
    return calls


def wide_float_calls(hlo_text: str) -> list[TritonCall]:
    """The Triton calls that receive a float operand wider than 16 bits."""
    return [c for c in triton_calls(hlo_text) if c.wide_floats]


def tensor_core_kernels(dump_dir) -> dict[str, bool]:
    """{dumped kernel file: whether its lowered code has wgmma instructions} for every
    `*.triton-to-llvm.txt` under `dump_dir` (see the module doc for the dump options)."""
    files = sorted(pathlib.Path(dump_dir).rglob("*.triton-to-llvm.txt"))
    return {f.name: WGMMA in f.read_text(errors="replace") for f in files}
