"""Packed documents through the whole model (`QwenMoe(..., segment_ids=, positions=)`): each
document's logits in a packed row equal its logits run alone, with both attention
implementations, scanned and unrolled layers (the MoE layers route token by token, so only the
attention could mix documents)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_models import input_ids, mesh, tiny

from relaymoe_jax.models import QwenMoe

DOC_LENGTHS = (7, 12, 5)  # then 8 padding tokens: S = 32


def packed_row(ids_s):
    """(ids, segment ids, positions) [1, 32]: the documents back to back, then padding (id 0)."""
    seg, pos = [], []
    for n, length in enumerate(DOC_LENGTHS, 1):
        seg += [n] * length
        pos += list(range(length))
    pad = ids_s.shape[0] - len(seg)
    seg, pos = seg + [0] * pad, pos + list(range(pad))
    return ids_s[None], jnp.asarray([seg], jnp.int32), jnp.asarray([pos], jnp.int32)


CASES = {
    "xla": dict(attention_impl="xla"),
    "chunked-scanned": dict(attention_impl="chunked", attention_block_k=8, scan_layers=True),
}


@pytest.mark.parametrize("kw", list(CASES.values()), ids=list(CASES))
def test_each_packed_document_gets_its_own_logits(kw):
    """Two programs per case: the packed row with its segment ids and positions, and the plain
    model (no segment ids) on a batch of the same row unmasked (the control) and each document
    alone at the start of a row of its own: the model is causal and routes token by token, so
    the zeros after a document cannot change its logits."""
    model = QwenMoe(tiny(**kw), mesh=mesh(), rngs=nnx.Rngs(0))
    ids, seg, pos = packed_row(input_ids(seed=4, b=1, s=32)[0])
    run = nnx.jit(lambda m, i, s, p: m(i, segment_ids=s, positions=p)[0])
    packed = np.asarray(run(model, ids, seg, pos), np.float64)
    rows, start = [np.asarray(ids[0])], 0
    for length in DOC_LENGTHS:
        rows.append(np.zeros(ids.shape[1], np.int32))
        rows[-1][:length] = ids[0, start : start + length]
        start += length
    plain = np.asarray(nnx.jit(lambda m, i: m(i)[0])(model, jnp.asarray(rows)), np.float64)
    unmasked, start = plain[:1], 0
    for n, length in enumerate(DOC_LENGTHS, 1):
        alone = plain[n : n + 1, :length]
        got = packed[:, start : start + length]
        scale = np.abs(alone).max()
        assert np.abs(got - alone).max() <= 2e-5 * scale, (start, length)
        if start:  # a control: without the segment ids the later documents read earlier ones
            assert np.abs(unmasked[:, start : start + length] - alone).max() > 1e-3 * scale
        start += length


BAD_INPUTS = {
    # name: (keyword, value for ids [1, 32], the message)
    "positions of another shape": (
        "positions",
        jnp.zeros((1, 31), jnp.int32),
        r"positions: shape \(1, 31\), expected \[batch, seq\] = \(1, 32\)",
    ),
    "positions without a batch dimension": (
        "positions",
        jnp.arange(32),
        r"positions: shape \(32,\), expected \[batch, seq\] = \(1, 32\)",
    ),
    "float positions (truncated before)": (
        "positions",
        jnp.arange(32, dtype=jnp.float32)[None] + 0.5,
        "positions: expected an integer dtype, got float32",
    ),
    "float segment ids": (
        "segment_ids",
        jnp.ones((1, 32), jnp.float32),
        "segment_ids: expected an integer dtype, got float32",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_positions_and_segment_ids_are_refused_before_rope(case, monkeypatch):
    """One ValueError naming the argument, the shape or dtype and what was expected, raised
    before RoPE is traced (a wrong shape used to fail inside RoPE with a broadcasting TypeError;
    float positions were truncated to integers silently)."""
    key, value, match = BAD_INPUTS[case]
    model = QwenMoe(tiny(), mesh=mesh(), rngs=nnx.Rngs(0))
    ids = input_ids(seed=4, b=1, s=32)
    monkeypatch.setattr("relaymoe_jax.models.qwen.rope_cos_sin", lambda *a: 1 / 0)
    with pytest.raises(ValueError, match=match):
        nnx.jit(lambda m, i, v: m(i, **{key: v})[0])(model, ids, value)
