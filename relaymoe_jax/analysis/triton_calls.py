"""The Pallas kernels of a compiled XLA:GPU program, and the operand types they really receive.

A Pallas (Triton lowering) kernel appears in `compiled.as_text()` as a custom call to
`__gpu$xla.gpu.triton` whose `operand_layout_constraints={...}` list the types it is launched with,
after every conversion XLA kept (and `output_to_operand_aliasing` names an operand the output is
written into: an in-place accumulator). Those, not the traced dtypes, decide the kernel's math: a
16-bit kernel handed a float32 operand multiplies in f32 FMA, without the tensor cores
(`kernels/gmm/common.py`). `triton_calls` reads them; `wide_float_calls` lists the calls that take a
float operand wider than 16 bits.

A Pallas Mosaic GPU kernel (`plgpu.kernel`: the flash attention of `kernels/attention/`) appears as
a custom call to `mosaic_gpu_v2` with the same `operand_layout_constraints`; `triton_calls(text,
targets=KERNEL_TARGETS)` (or `mosaic_calls`) reads those too. Its float operands of rank 4 are the
[batch, seq, heads, head_dim] tiles its wgmmas multiply; its rank-3 float32 operands are per-row
statistics (the log-sum-exp, the backward's rowsum(dO * O)), which it never multiplies, so
`wide_floats` leaves them out.

The lowered Triton IR says the same from the other side: compiled with the XLA debug options
`xla_dump_to=DIR` and `xla_dump_emitter_re=.*` (they work deviceless), each kernel's pass pipeline
is dumped to `DIR/*.triton-to-llvm.txt`, and `tensor_core_kernels(DIR)` tells, per file, whether
its lowered code issues Hopper `wgmma` instructions. A Mosaic GPU kernel is compiled by the CUDA
plugin from the environment variables `MOSAIC_GPU_DUMP_TO=DIR` and `MOSAIC_GPU_DUMP_PTX=1` (jax
0.12 reads them at each Mosaic GPU compile; a kernel the process compiled before is not compiled,
nor dumped, again) to `DIR/*.ptx`, and
`mosaic_wgmma_kernels(DIR)` gives, per kernel, its wgmma instruction shapes (e.g.
`m64n128k16.f32.bf16.bf16`: bf16 operands accumulated in f32).
"""

import dataclasses
import pathlib
import re

TRITON_TARGET = "__gpu$xla.gpu.triton"
MOSAIC_TARGET = "mosaic_gpu_v2"
KERNEL_TARGETS = (TRITON_TARGET, MOSAIC_TARGET)
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
    target: str = TRITON_TARGET  # the custom call's target (TRITON_TARGET or MOSAIC_TARGET)

    @property
    def kernel(self) -> str:
        """The Pallas kernel's name: the op_name component before `/pallas_call` (Triton) or
        `/mpmd_map` (Mosaic GPU)."""
        parts = self.op_name.split("/")
        launch = parts[-1] in ("pallas_call", "mpmd_map")
        return parts[-2] if len(parts) > 1 and launch else self.op_name

    @property
    def wide_floats(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The operands of a float type wider than 16 bits (f32, f64) that the kernel multiplies
        (the others: `_added`)."""
        return tuple(
            o
            for i, o in enumerate(self.operands)
            if _FLOAT_BITS.get(o[0], 0) > 16 and not self._added(i)
        )

    def _added(self, i: int) -> bool:
        """Operand `i` is summed or kept, not multiplied: one aliased to the output (either
        backend's tgmm's in-place accumulator, `tgmm(acc=)`); another Mosaic GPU kernel's
        operand of rank below 4 (the attention's row statistics: the module doc). The Mosaic
        GPU gmm and tgmm multiply every other float operand they take; the gmm's e4m3 form
        (`relaymoe_gmm_fp8`) multiplies its e4m3 operands and applies its float32 ones, the block
        scales, to the float32 partial products in registers."""
        if i in self.aliased:
            return True
        if self.target == MOSAIC_TARGET and "relaymoe_gmm_fp8" in self.kernel:
            return True
        if self.target != MOSAIC_TARGET or "relaymoe_gmm" in self.kernel:
            return False
        return "relaymoe_tgmm" not in self.kernel and len(self.operands[i][1]) < 4


def triton_calls(hlo_text: str, targets: tuple[str, ...] = (TRITON_TARGET,)) -> list[TritonCall]:
    """Every custom call to one of `targets` (default: Triton's) of a compiled program's HLO
    text, in program order."""
    calls = []
    for line in hlo_text.splitlines():
        target = next((t for t in targets if f'custom_call_target="{t}"' in line), None)
        if target is None:
            continue
        name, ops = _NAME.match(line), _OPERANDS.search(line)
        if name is None or ops is None:
            raise ValueError(f"a {target} custom call without operand types: {line[:200]}")
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
                target,
            )
        )
    return calls


def mosaic_calls(hlo_text: str) -> list[TritonCall]:
    """Every Pallas Mosaic GPU custom call (`MOSAIC_TARGET`), in program order."""
    return triton_calls(hlo_text, (MOSAIC_TARGET,))


def wide_float_calls(hlo_text: str) -> list[TritonCall]:
    """The Pallas calls (Triton and Mosaic GPU) that receive a float operand wider than 16 bits
    that they multiply."""
    return [c for c in triton_calls(hlo_text, KERNEL_TARGETS) if c.wide_floats]


def tensor_core_kernels(dump_dir) -> dict[str, bool]:
    """{dumped kernel file: whether its lowered code has wgmma instructions} for every
    `*.triton-to-llvm.txt` under `dump_dir` (see the module doc for the dump options)."""
    files = sorted(pathlib.Path(dump_dir).rglob("*.triton-to-llvm.txt"))
    return {f.name: WGMMA in f.read_text(errors="replace") for f in files}


_WGMMA_SHAPE = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)")


def mosaic_wgmma_kernels(dump_dir) -> dict[str, tuple[str, ...]]:
    """{dumped Mosaic GPU kernel (`*.ptx` under `dump_dir`): the sorted wgmma instruction shapes
    in its PTX, e.g. ("m64n128k16.f32.bf16.bf16",); empty if it has none} (module doc)."""
    files = sorted(pathlib.Path(dump_dir).rglob("*.ptx"))
    return {
        f.name: tuple(sorted(set(_WGMMA_SHAPE.findall(f.read_text(errors="replace")))))
        for f in files
    }
