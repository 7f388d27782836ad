"""Flash attention as Pallas Mosaic GPU kernels (Hopper): `flash_attention` (api.py) over the
forward (mosaic_fwd.py) and backward (mosaic_bwd.py) kernels; common.py holds the shared checks,
config and the prepared masks (the block ranges each kernel walks)."""

from relaymoe_jax.kernels.attention.api import flash_attention
from relaymoe_jax.kernels.attention.common import HEAD_DIMS, MosaicConfig

__all__ = ["HEAD_DIMS", "MosaicConfig", "flash_attention"]
