"""Low-precision formats of the expert GEMMs: `fp8` (blockwise e4m3)."""
