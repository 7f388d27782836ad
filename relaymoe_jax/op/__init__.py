"""The op's front door: `moe_ffn` (global arrays), `moe_ffn_local` (inside your shard_map),
`routing_plan`, the options record, and the static checks that run before anything is traced.

    api.py          moe_ffn, moe_ffn_local, routing_plan: the public functions
    options.py      MoEOptions: the execution options, one typed record validated once
    checks.py       arrays, mesh axes and sizes, checked before tracing (named records)
    resolve.py      the one front door: sizes + options + placement -> the static LocalSpec
    global_call.py  moe_ffn's path: placement on the mesh, the cached program, its shard_map
    local_call.py   moe_ffn_local's path: axes from the caller's shard_map and x's types
    layout.py       where x's tokens live (read, not imposed)
    topology.py     flat or hierarchical ring, from the devices' hosts
"""

from relaymoe_jax.op.api import moe_ffn, moe_ffn_local, routing_plan
from relaymoe_jax.op.options import MoEOptions

__all__ = ["MoEOptions", "moe_ffn", "moe_ffn_local", "routing_plan"]
