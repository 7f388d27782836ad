"""The dispatchers: each device's MoE step, run inside `jax.shard_map` (no global arrays here).

local.py      LocalSpec and local_moe: the expert-tensor plumbing around ring or all-to-all
ring.py       RelayMoE's ring (expert and token routing, flat or hierarchical), custom VJP
hop.py        one ring hop: the pairs of one token partition meeting one expert partition
alltoall.py   the Megatron-style all-to-all baseline (dropless, or with a capacity factor)
experts.py    the Experts record (weights and optional biases) and the one expert MLP
reference.py  the dense single-device definition (ground truth)
pairs.py      pair bookkeeping: sort order, offsets, row gathers, NaN poisoning (indices only)
chunking.py   the ring's default chunk size
mode.py       paper Table 2: bytes per hop of each routing mode, and the cheaper one
"""
