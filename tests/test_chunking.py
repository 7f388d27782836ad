"""The ring's default chunk (`relaymoe_jax.dispatch.chunking`) and where it is used."""

import pytest

from relaymoe_jax import routing_volumes
from relaymoe_jax.analysis import memory
from relaymoe_jax.dispatch import chunking
from relaymoe_jax.op.checks import Dtypes, Sizes
from relaymoe_jax.op.options import MoEOptions
from relaymoe_jax.op.resolve import Placement, ring_choice


@pytest.mark.parametrize(
    "tokens, k, ep, want",
    [
        (61_440, 8, 8, 8_192),  # the paper's shape: 61,440 pairs per hop, 8 chunks
        (61_440, 16, 8, 8_192),  # 122,880 pairs per hop, 15 chunks
        (4_096, 8, 8, 4_096),  # a hop of 4,096 pairs runs in one chunk, as before
        (8_193, 8, 8, 8_192),  # ceil(65,544 / 8) = 8,193 > 8,192
        (7, 3, 4, 6),  # ceil(21 / 4)
    ],
)
def test_default_is_the_balanced_share_capped_at_8192(tokens, k, ep, want):
    assert chunking.default_chunk(tokens, k, ep, 128) == want
    assert chunking.balanced_share(tokens, k, ep) == -(-tokens * k // ep)


def test_the_op_the_volumes_and_the_memory_model_share_the_default():
    sizes = Sizes(lead=(61_440,), tokens=61_440, hidden=2048, top_k=8, experts=128, ffn=768)
    dtypes = Dtypes(x="bfloat16", weights="bfloat16", router="float32")
    where = Placement(("expert",), None, 8, 1, 61_440, False, (), 1, False)
    chunk = ring_choice(MoEOptions(routing="expert"), sizes, dtypes, where).chunk
    assert chunk == 8_192
    given = ring_choice(MoEOptions(routing="expert", chunk_size=20_000), sizes, dtypes, where)
    assert given.chunk == 20_000
    s = memory.LayerShape(
        experts=128, top_k=8, hidden=2048, ffn=768, tokens_per_device=61_440, ep=8
    )
    assert s.chunk_rows == 8_192
    # the token ring's sent bytes carry the pair order's padding by one chunk: (C + E) * 4
    vol = routing_volumes(
        experts=128, top_k=8, hidden=2048, ffn=768, ep=8, tokens_per_device=61_440
    )
    big = routing_volumes(
        experts=128, top_k=8, hidden=2048, ffn=768, ep=8, tokens_per_device=61_440, chunk=61_440
    )
    assert big.sent_token_fwd - vol.sent_token_fwd == (61_440 - 8_192) * 4
