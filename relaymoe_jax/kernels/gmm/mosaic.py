"""Pallas Mosaic GPU grouped matmul `gmm` and its ragged-contracting form `tgmm` (Hopper): the
public entry points and their argument checks. The kernels are `mosaic_gmm.py` (forward and dx)
and `mosaic_tgmm.py` (dW); `mosaic_common.py` describes their shape. Differentiation: the custom
VJPs of `vjp.py`, whose backward passes are these same kernels.

Contract: `api.py`'s, as the Triton kernel's (`pallas.py`): rows >= sum(group_sizes) come back as
exact zeros (unless `zero_padding=False`) and never reach a stored row or a weight gradient (NaN
included), empty and negative groups, sums past M cut at M. Operands multiply in bf16/f16 on the
tensor cores (a float32 operand meeting a 16-bit one is cast down, `common.operand_dtype`),
accumulating in float32; float32 x float32 is refused (wgmma has no IEEE float32 path: use "xla").
Row gathers (`lhs_rows`, `rhs_rows`) are done by XLA inside the op (Hopper's TMA cannot gather
rows): the gathered [M, K] exists for the kernel call only, as one ring chunk's rows.
"""

import dataclasses

import jax
import numpy as np

from relaymoe_jax.kernels.gmm.mosaic_common import MosaicConfig, check_config
from relaymoe_jax.kernels.gmm.vjp import gmm_entry, tgmm_entry


def make_config(interpret, zero_padding=True, config=None) -> MosaicConfig:
    """The checked config: `config` (or the defaults) with `interpret` and `zero_padding`."""
    if not isinstance(zero_padding, (bool, np.bool_)):
        raise ValueError(f"zero_padding must be a bool, got {zero_padding!r}")
    if config is not None and not isinstance(config, MosaicConfig):
        raise ValueError(f"config must be a MosaicConfig, got {type(config).__name__}")
    base = config or MosaicConfig()
    interpret = interpret if interpret is not False else base.interpret
    return check_config(
        dataclasses.replace(base, interpret=interpret, zero_padding=bool(zero_padding))
    )


def gmm(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    transpose_rhs=False,
    lhs_rows=None,
    interpret=False,
    zero_padding=True,
    config=None,
) -> jax.Array:
    """Grouped matmul by the Mosaic GPU kernel: out[M, N], rows of group g @ rhs[g] (rhs[g].T if
    `transpose_rhs`). lhs [M, K] (or a [T, K] row source with `lhs_rows` [M]), rhs [G, K, N] /
    [G, N, K]; `interpret` (True or `plgpu.InterpretGPUParams`) runs the GPU interpreter;
    `config` a `MosaicConfig`. `zero_padding` as in `pallas.gmm`. Differentiable in lhs and rhs."""
    return gmm_entry(
        lhs,
        rhs,
        group_sizes,
        lhs_rows,
        transpose_rhs,
        preferred_element_type,
        lambda: make_config(interpret, zero_padding, config),
    )


def tgmm(
    lhs,
    rhs,
    group_sizes,
    *,
    preferred_element_type=None,
    lhs_rows=None,
    rhs_rows=None,
    interpret=False,
    acc=None,
    config=None,
) -> jax.Array:
    """Transposed grouped matmul by the Mosaic GPU kernel: out[g] = lhs[g rows].T @ rhs[g rows],
    [G, K, N] (+ `acc`, updated in place where XLA can give the output acc's buffer). Arguments as
    in `pallas.tgmm` and `gmm` above. Differentiable in lhs, rhs and acc."""
    return tgmm_entry(
        lhs,
        rhs,
        group_sizes,
        lhs_rows,
        rhs_rows,
        preferred_element_type,
        acc,
        lambda: make_config(interpret, True, config),
    )
