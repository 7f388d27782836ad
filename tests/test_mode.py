"""Paper Table 2: per-hop ring volume of expert routing vs token routing, with SP, CP and ETP."""

import jax.numpy as jnp
import numpy as np
import pytest

from relaymoe_jax.dispatch.mode import routing_volumes

QWEN = dict(experts=128, top_k=8, hidden=2048, ffn=768, ep=8)  # Qwen3-30B-A3B-like
E384 = dict(experts=384, hidden=2048, ffn=2048, ep=8)


def test_qwen3_long_sequence_prefers_expert_routing():
    v = routing_volumes(**QWEN, batch=1, seq_len=131072)
    # expert: 128/8 = 16 experts x W, W = 3*2048*768 * 2 B (bf16) = 9,437,184 B -> 150,994,944 B
    assert v.experts_per_device == 16
    assert v.expert_bytes == 3 * 2048 * 768 * 2
    assert v.expert_fwd == 16 * 3 * 2048 * 768 * 2
    # token: 131072 tokens x (H + M), H = 2048 * 2 = 4096 B, M = 8 * (4 + 4) = 64 B
    #        -> 131072 * 4160 = 545,259,520 B
    assert v.tokens_per_device == 131072
    assert v.token_bytes == 2048 * 2 + 8 * (4 + 4)
    assert v.token_fwd == 131072 * (2048 * 2 + 8 * (4 + 4))
    assert (v.expert_bwd, v.token_bwd) == (2 * v.expert_fwd, 2 * v.token_fwd)
    # What the ring sends: + the f32 dW accumulator (expert bwd); + the f32 output accumulator,
    # the order's one-chunk padding (C = min(131072*8/8, 8192), the default chunk) and 128 counts
    # (token fwd).
    assert v.sent_expert_bwd == 16 * 3 * 2048 * 768 * (2 + 4)
    assert v.sent_token_fwd == 131072 * (4096 + 64 + 2048 * 4) + (8192 + 128) * 4
    assert v.choice == "expert"  # 151 MB < 545 MB in Table 2, and in what is sent


@pytest.mark.parametrize("top_k", [12, 16])
def test_e384_short_sequence_prefers_token_routing(top_k):
    v = routing_volumes(**E384, top_k=top_k, batch=1, seq_len=20480)
    # expert: 384/8 = 48 experts x 3*2048*2048*2 B = 48 x 25,165,824 = 1,207,959,552 B
    assert v.expert_fwd == 48 * 3 * 2048 * 2048 * 2
    # token: 20480 x (4096 + k*8): k=12 -> 20480 * 4192 = 85,852,160 B; k=16 -> 20480 * 4224
    assert v.token_fwd == 20480 * (2048 * 2 + top_k * (4 + 4))
    assert (v.expert_bwd, v.token_bwd) == (2 * v.expert_fwd, 2 * v.token_fwd)
    # backward sends x and dy (bf16), metadata, and the f32 dx and d expert_weights accumulators.
    c = min(20480 * top_k // 8, 8192)  # the default chunk: the balanced share, at most 8,192
    assert v.sent_token_bwd == 20480 * (2 * 4096 + top_k * 8 + 2048 * 4 + top_k * 4) + (c + 384) * 4
    assert v.choice == "token"


def test_sp_cp_divide_tokens_and_token_volume():
    base = routing_volumes(**QWEN, batch=1, seq_len=131072)
    for sp, cp in [(1, 4), (4, 1), (2, 2)]:
        v = routing_volumes(**QWEN, batch=1, seq_len=131072, sp=sp, cp=cp)
        assert v.tokens_per_device == 131072 // 4
        assert v.token_fwd * 4 == base.token_fwd
        assert v.expert_fwd == base.expert_fwd
    v = routing_volumes(**QWEN, batch=4, seq_len=8192, sp=2, cp=4)
    assert v.tokens_per_device == 4 * 8192 // (2 * 4)
    assert v == routing_volumes(**QWEN, tokens_per_device=4096)


def test_etp_divides_expert_volume():
    base = routing_volumes(**QWEN, batch=1, seq_len=131072)
    v = routing_volumes(**QWEN, batch=1, seq_len=131072, etp=4)
    assert v.expert_bytes == 3 * 2048 * (768 // 4) * 2
    assert v.expert_fwd * 4 == base.expert_fwd
    assert v.token_fwd == base.token_fwd


def test_etp_flips_token_to_expert():
    # At 65536 tokens: Table 2 token fwd = 65536 * 4192 B = 275 MB < expert 1.21 GB; with etp=8
    # expert fwd is 151 MB. What is sent (fwd + bwd): expert 48 * 3*2048*2048 * (2 + 2 + 4) / etp
    # = 4.83 GB / etp; token ~ 65536 * (4192 + 8192 + 8192 + 96 + 8192 + 48) B = 1.89 GB.
    no_etp = routing_volumes(**E384, top_k=12, batch=1, seq_len=65536)
    etp8 = routing_volumes(**E384, top_k=12, batch=1, seq_len=65536, etp=8)
    assert no_etp.token_fwd == etp8.token_fwd == 65536 * 4192
    assert etp8.expert_fwd == 48 * 3 * 2048 * (2048 // 8) * 2
    assert etp8.sent_expert_bwd == 48 * 3 * 2048 * (2048 // 8) * (2 + 4)
    assert (no_etp.choice, etp8.choice) == ("token", "expert")


def test_choice_is_the_lower_sent_total_and_ties_go_to_expert():
    for t in range(1, 4000, 7):
        v = routing_volumes(experts=8, top_k=2, hidden=64, ffn=64, ep=8, tokens_per_device=t)
        expert = v.sent_expert_fwd + v.sent_expert_bwd
        token = v.sent_token_fwd + v.sent_token_bwd
        assert v.choice == ("expert" if expert <= token else "token"), t
    small = routing_volumes(experts=8, top_k=2, hidden=64, ffn=64, ep=8, tokens_per_device=1)
    big = routing_volumes(experts=8, top_k=2, hidden=64, ffn=64, ep=8, tokens_per_device=3999)
    assert (small.choice, big.choice) == ("token", "expert")


def test_dtypes_and_weight_dtype_default():
    a = routing_volumes(
        **QWEN, tokens_per_device=1024, act_dtype=jnp.bfloat16, router_dtype=np.float32
    )
    assert a == routing_volumes(**QWEN, tokens_per_device=1024)
    fp8 = routing_volumes(
        **QWEN, tokens_per_device=1024, weight_dtype="float8_e4m3fn", router_dtype="bfloat16"
    )
    assert fp8.expert_bytes == 3 * 2048 * 768 * 1
    assert fp8.token_bytes == 2048 * 2 + 8 * (4 + 2)
    f32 = routing_volumes(**QWEN, tokens_per_device=1024, act_dtype="float32")
    assert f32.expert_bytes == 3 * 2048 * 768 * 4  # weight_dtype follows act_dtype


def test_explain():
    v = routing_volumes(**E384, top_k=12, batch=1, seq_len=20480)
    assert v.explain().startswith(
        "routing 'token': per-hop fwd+bwd bytes sent expert 4.83 GB vs token "
    )
    assert v.explain().endswith(
        "Table 2 forward: expert 1.21 GB (48 experts x 25.2 MB) vs token "
        "85.9 MB (20480 tokens x 4192 B)"
    )
    s = routing_volumes(**QWEN, batch=1, seq_len=131072).explain()
    assert "'expert'" in s and "151 MB" in s and "545 MB" in s
    assert "\n" not in s


LONG = dict(QWEN, batch=1, seq_len=131072)


@pytest.mark.parametrize(
    "overrides, names",
    [
        *[(dict(experts=bad), ["experts", repr(bad)]) for bad in (0, -128, 128.0, True)],
        (dict(top_k=0), ["top_k", "0"]),
        (dict(hidden=-1), ["hidden", "-1"]),
        (dict(ffn=1.5), ["ffn", "1.5"]),
        (dict(ep=False), ["ep", "False"]),
        (dict(sp=0), ["sp", "0"]),
        (dict(cp=-2), ["cp", "-2"]),
        (dict(etp=2.0), ["etp", "2.0"]),
        (dict(batch=0), ["batch", "0"]),
        (dict(seq_len=1.0), ["seq_len", "1.0"]),
        (dict(batch=None, seq_len=None, tokens_per_device=0), ["tokens_per_device", "0"]),
        (dict(experts=100), ["experts", "100", "ep", "8"]),
        (dict(etp=5), ["ffn", "768", "etp", "5"]),
        (dict(top_k=129), ["top_k", "129", "experts"]),
        (dict(seq_len=131071, cp=2), ["seq_len", "131071", "cp"]),
        (dict(tokens_per_device=16), ["tokens_per_device", "16"]),
        (dict(batch=None, seq_len=None), ["tokens_per_device", "batch", "seq_len"]),
        (dict(seq_len=None), ["seq_len", "None"]),
        (dict(act_dtype="bfloat17"), ["act_dtype", "bfloat17"]),
        (dict(weight_dtype="not_a_dtype"), ["weight_dtype", "not_a_dtype"]),
        (dict(router_dtype="float99"), ["router_dtype", "float99"]),
        (dict(router_dtype=None), ["router_dtype", "None"]),
    ],
)
def test_validation_errors(overrides, names):
    with pytest.raises(ValueError) as err:
        routing_volumes(**{**LONG, **overrides})
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize("tokens", [64, 4096, 61440])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_link_classes(tokens, hierarchical):
    """Bytes per link class (`link_bytes`): on 8 hosts of 8 the hierarchical ring sends
    (hosts - 1) payloads per pass across hosts and hosts * 7 within, the flat ring's busiest GPU
    63 of each; on one host nothing crosses. Both classes scale the same payloads, so the choice
    is the one-host choice (what `routing="auto"` picked before hosts were counted)."""
    kw = dict(
        experts=128,
        top_k=8,
        hidden=2048,
        ffn=768,
        ep=64,
        tokens_per_device=tokens,
        act_dtype="bfloat16",
    )
    one = routing_volumes(**kw)
    v = routing_volumes(**kw, hosts=8, hierarchical=hierarchical)
    for mode in ("expert", "token"):
        per = getattr(v, f"sent_{mode}_fwd") + getattr(v, f"sent_{mode}_bwd")
        want = (8 * 7 * per, 7 * per) if hierarchical else (63 * per, 63 * per)
        assert v.link_bytes(mode) == want
        assert one.link_bytes(mode) == (63 * per, 0)
    assert v.choice == one.choice
    assert ("across hosts" in v.explain()) and ("across hosts" not in one.explain())


def test_hosts_must_divide_ep():
    with pytest.raises(ValueError, match="ep must be divisible by hosts, got ep=8, hosts=3"):
        routing_volumes(experts=8, top_k=2, hidden=8, ffn=8, ep=8, tokens_per_device=8, hosts=3)
