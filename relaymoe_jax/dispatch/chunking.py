"""The ring's default chunk: how many (token, expert) pairs one hop computes at a time.

A hop walks its pairs (about T*k/EP of them, the balanced share) in chunks of C pairs; each chunk
keeps its own intermediates live (gate and up [C, F] in float32; in the backward also their
cotangents, the [C, H] rows and the dx rows), so C sets the ring's peak above the tokens' own
buffers. The rule:

    C = min(balanced share, CHUNK_PAIRS),   CHUNK_PAIRS = 8,192

Memory. At the paper's shape (E=128, H=2048, F=768, 61,440 tokens per device, EP=8, bf16)
compiled for 8 x H100 with `XLA_OPTIONS`, 8,192 is the largest power of two that meets the goal
capacity-1.0 all-to-all / ring >= 8x at k=8 and >= 15x at k=16 against the all-to-all after its
bf16 fix; 16,384 gives 7.5x and 14.8x (BENCHMARKS.md "The ring's default chunk", printed by
`python benchmarks/chunk.py`).

Time. What a chunk costs besides its matmuls, per chunk: 3 forward and 8 backward kernel launches,
and the weight-gradient sum, which `tgmm(acc=)` does in place for the experts the chunk touches
only. A chunk is a contiguous run of the hop's expert-sorted pairs, so it spans about
C / (T*k/E) + 1 experts, each with ~T*k/E rows (3,840 at the paper's k=8, 2 to 4 experts per
chunk): the grouped matmuls see groups of thousands of rows, far above the kernel's 64-row tiles,
and the row tiles shared by two experts (computed once per expert) are at most ~4 per chunk. At
8,192 pairs a chunk's fwd+bwd is 18*C*H*F = 232 GFLOP (0.7 ms at the cost model's 346 TFLOP/s)
against ~11 launches of a few microseconds: the assumption is that this overhead stays under ~10%,
to be checked by the hop timing of the prepared GPU run (`benchmarks/gpu.py`, "One ring hop").
Never more than the balanced share: a hop holding fewer pairs runs in one chunk.
"""

CHUNK_PAIRS = 8_192


def balanced_share(ring_tokens: int, top_k: int, ep: int) -> int:
    """ceil(T*k / EP): the pairs one hop computes when the router spreads them evenly."""
    return max(1, -(-ring_tokens * top_k // ep))


def default_chunk(ring_tokens: int, top_k: int, ep: int, num_experts: int) -> int:
    """The ring's default pairs per chunk for `ring_tokens` tokens per ring member (module doc).

    `num_experts` is kept for rules that depend on the experts per device; this one does not."""
    del num_experts
    return min(balanced_share(ring_tokens, top_k, ep), CHUNK_PAIRS)
