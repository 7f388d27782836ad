"""The train step on packed rows (`train.step.train_step.make_step(packed=True)`): the loss mask
keeps exactly the targets inside a document (against a numpy rule), and the step's lm_loss on a
batch of packed documents (with padding) is the mean next-token loss of the documents run alone
through the same model, computed in float64 numpy from their logits."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from relaymoe_jax.models.config_files import load_config
from train.data import Batch
from train.settings import TrainConfig
from train.step import mesh as tm
from train.step import train_step

B, S = 8, 16


def _packed_batch(seed: int):
    """[B, S] rows of documents of 1..9 tokens back to back, padding (segment 0) at some ends;
    (tokens, segment ids, positions, [(row, start, length)] of the documents)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 256, (B, S)).astype(np.int32)
    seg, pos = np.zeros((B, S), np.int32), np.zeros((B, S), np.int32)
    docs = []
    for r in range(B):
        t, n = 0, 0
        while t < S - 2:
            length = min(int(rng.integers(1, 10)), S - t)
            n += 1
            seg[r, t : t + length], pos[r, t : t + length] = n, np.arange(length)
            docs.append((r, t, length))
            t += length
        tokens[r, t:] = 0  # padding
    return tokens, seg, pos, docs


def test_loss_weights_keep_the_targets_inside_a_document():
    tokens, seg, _, _ = _packed_batch(0)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, jax.P("expert")))
    targets, weights = jax.jit(train_step.next_token_targets)(put(tokens), put(seg))
    want = np.zeros((B, S), np.float32)
    for r in range(B):
        for t in range(S - 1):
            want[r, t] = seg[r, t] != 0 and seg[r, t + 1] == seg[r, t]
    np.testing.assert_array_equal(np.asarray(weights), want)
    np.testing.assert_array_equal(np.asarray(targets)[:, :-1], tokens[:, 1:])


def _nll(logits, ids) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of one document (float64) and its targets."""
    z = np.asarray(logits, np.float64)[0, :-1]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(ids)[0, 1:, None], -1).sum(), ids.shape[1] - 1


def test_packed_lm_loss_is_the_documents_loss_alone():
    cfg = load_config("configs/tiny.yaml").replace(dispatcher="reference")
    tc = TrainConfig(batch_size=B, seq_len=S, warmup_steps=0)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)
    model = nnx.merge(graphdef, jax.tree.map(train_step.gather_stored, state.params), state.rest)
    tokens, seg, pos, docs = _packed_batch(1)
    # every document alone at the start of a row of its own, in one call (one compile): the
    # model is causal and the reference dispatcher routes each token on its own, so what
    # follows a document in its row cannot change its logits
    docs = [(r, t, length) for r, t, length in docs if length > 1]
    alone_rows = np.zeros((-(-len(docs) // 8) * 8, S), np.int32)
    for i, (r, t, length) in enumerate(docs):
        alone_rows[i, :length] = tokens[r, t : t + length]
    logits = np.asarray(nnx.jit(lambda m, i: m(i)[0])(model, jnp.asarray(alone_rows)))
    total, count = 0.0, 0
    for i, (_, _, length) in enumerate(docs):
        nll, n = _nll(logits[i : i + 1, :length], alone_rows[i : i + 1, :length])
        total, count = total + nll, count + n
    ids_sharding = NamedSharding(mesh, rules.fit((B, S), "batch", "seq"))
    step = train_step.make_step(graphdef, tx, packed=True)
    compiled = train_step.compile_step(step, state, ids_sharding, (B, S), packed=True)
    batch = jax.device_put(Batch(tokens, seg, pos), ids_sharding)
    _, metrics = compiled(state, batch)
    np.testing.assert_allclose(float(metrics.lm_loss), total / count, rtol=2e-6)
