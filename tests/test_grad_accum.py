"""Gradient accumulation, `grad_accum=N` (`train/accumulate.py`).

- One and two optimizer steps of grad_accum=4, batch_size=2 equal those of batch_size=8 (the same
  rows: packed documents of a multi-document corpus, read by the trainer's loader), with the
  router's aux loss off and the aux-loss-free expert bias on: losses, gradient norm, expert load
  and bias exactly, the parameters (float32, 1e-6 relative), and the summed gradient itself.
- With the aux loss (and the z-loss) on, the step equals an independent reference: each
  micro-batch's gradients by the ordinary batch_size=2 loss (no scan), combined as documented (LM
  part by token weights, router part 1/N each), then one AdamW update; and that differs from
  batch_size=8 (the aux loss is averaged per micro-batch, not computed on the whole batch).
- The trainer runs grad_accum=2 (reading the rows batch_size=4 reads), resumes bitwise, refuses a
  resume that changes grad_accum, and refuses grad_accum=0 in one line.
- The accumulated step's temporaries are one micro-batch's plus the float32 accumulator.

Why the parameters are compared to 1e-6 where the gradient is >= 1e-5 (about 80% of them here):
AdamW's first update of an element is lr * g / (|g| + 1e-8), whose derivative in g is large
where |g| is small; float32 summation order changes g by up to ~1e-8 (absolute), which moves
the update of an element with |g| ~ 1e-8 by O(lr). The summed gradient itself is compared to
1e-6 (`test_summed_gradient_equals_one_batch`).
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from corpora import word_corpus
from jax.sharding import NamedSharding

from relaymoe_jax.models.config_files import load_config
from train import accumulate, cli, identity, train_step
from train import data as data_mod
from train import mesh as tm
from train.settings import TrainConfig

S = 16
LR = 3e-3
TIMING = ("tokens_per_s", "step_time", "data_time")


def _cfg(**over):
    return load_config("configs/tiny.yaml").replace(dispatcher="ring", **over)  # dropless


def _tc(b: int, n: int = 1) -> TrainConfig:
    return TrainConfig(
        batch_size=b, grad_accum=n, seq_len=S, lr=LR, warmup_steps=0, weight_decay=0.0
    )


def _setup(cfg, b: int, n: int, packed: bool):
    """(graphdef, initial state, tx, compiled step, its batch sharding and shape)."""
    tc = _tc(b, n)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)
    ids = NamedSharding(mesh, rules.fit((b, S), "batch", "seq"))
    sharding, shape = accumulate.step_batch(ids, b, S, n)
    step = train_step.make_step(graphdef, tx, packed=packed, grad_accum=n)
    compiled = train_step.compile_step(step, state, sharding, shape, packed=packed)
    return graphdef, state, tx, compiled, sharding, shape


def _train(cfg, b: int, n: int, batches, packed: bool):
    """[(state, metrics)] after each of `batches` (global batches of b * n rows) through the
    trainer's compiled step and expert-bias update, on host."""
    graphdef, state, _, compiled, sharding, shape = _setup(cfg, b, n, packed)
    out = [jax.device_get(state)]
    for batch in batches:
        state, m = compiled(state, accumulate.put_batch(batch, sharding, shape))
        if cfg.moe.expert_bias:
            state = train_step.update_expert_bias(graphdef, state, m.expert_load)
        out.append((jax.device_get(state), jax.device_get(m)))
    return out


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_update_close(p0, want, got):
    """The first AdamW update (weight decay 0) of `got` equals `want`'s to 1e-6 relative where
    it is determined by the gradient to float32 precision (|update| >= 0.999 lr, i.e. |g| >= 1e-5:
    see the module docstring), which is most elements, and within lr elsewhere."""
    determined = moved = 0
    for x0, w, g in zip(_leaves(p0), _leaves(want), _leaves(got)):
        u = np.abs(w - x0)
        sure = u >= 0.999 * LR
        np.testing.assert_allclose(g[sure], w[sure], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(g, w, rtol=0, atol=LR)
        determined, moved = determined + sure.sum(), moved + (u > 0).sum()
    assert determined >= 0.6 * moved, (determined, moved)


def _rows(ds, steps: int):
    """The first `steps` global batches of 8 rows the trainer's loader reads from `ds`."""
    source = data_mod.make_source(
        [str(ds)], synthetic=False, seq_len=S, batch_size=8, seed=0, vocab_size=256
    )
    assert source.packed  # several documents per row: segment ids
    return [next(source) for _ in range(steps)]


@pytest.fixture(scope="module")
def packed_rows(tmp_path_factory):
    return _rows(word_corpus(tmp_path_factory.mktemp("docs"), 60, max_words=6), 2)


def test_accumulated_steps_equal_one_batch(packed_rows):
    cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0, expert_bias=True)
    ref = _train(cfg, 8, 1, packed_rows, packed=True)
    acc = _train(cfg, 2, 4, packed_rows, packed=True)
    for (s_ref, m_ref), (s_acc, m_acc) in zip(ref[1:], acc[1:]):
        for k in ("loss", "lm_loss", "z_loss", "grad_norm"):
            assert float(getattr(m_acc, k)) == pytest.approx(float(getattr(m_ref, k)), rel=1e-6)
        np.testing.assert_array_equal(m_acc.expert_load, m_ref.expert_load)  # the same routing
        assert int(m_acc.dropped_pairs) == int(m_ref.dropped_pairs) == 0
        for x, y in zip(_leaves(s_acc.rest), _leaves(s_ref.rest)):  # the expert bias
            np.testing.assert_array_equal(x, y)
        assert np.any(_leaves(s_acc.rest)[0] != 0)  # the bias moved
    _assert_update_close(ref[0].params, ref[1][0].params, acc[1][0].params)
    for x, y in zip(_leaves(acc[2][0].params), _leaves(ref[2][0].params)):  # after 2 steps
        assert _rel(x, y) < 1e-4


def test_summed_gradient_equals_one_batch(packed_rows):
    cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    tc = _tc(8)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, _, rules = train_step.init_state(cfg, tc, mesh)
    one = jax.jit(jax.value_and_grad(train_step.make_loss(graphdef, packed=True), has_aux=True))
    summed = jax.jit(accumulate.accumulated_value_and_grad(graphdef, jnp.float32, 1024, True, 4))
    ids8 = NamedSharding(mesh, rules.fit((8, S), "batch", "seq"))
    ids2 = NamedSharding(mesh, rules.fit((2, S), "batch", "seq"))
    sharding, shape = accumulate.step_batch(ids2, 2, S, 4)
    b = packed_rows[0]
    (_, (lm1, _)), g1 = one(state.params, state.rest, accumulate.put_batch(b, ids8, (8, S)))
    batch = accumulate.put_batch(b, sharding, shape)
    (_, (lm4, _)), g4 = summed(state.params, state.rest, batch)
    assert float(lm4) == pytest.approx(float(lm1), rel=1e-6)
    for x, y in zip(_leaves(g4), _leaves(g1)):
        assert x.dtype == np.float32 and _rel(x, y) < 1e-6


def _target_weight(batch) -> float:
    """The targets of rows (numpy): each position but the last, within one document."""
    seg = np.asarray(batch.segment_ids)
    return float(np.sum((seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1])))


def test_aux_loss_is_averaged_per_micro_batch(packed_rows):
    """The accumulated step with the aux and z losses on equals the documented combination of
    per-micro-batch gradients of the ordinary step's loss, and not batch_size=8's."""
    n, b = 4, 2
    cfg = _cfg(router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    rows = packed_rows[0]
    s0, (s_acc, m_acc) = _train(cfg, b, n, [rows], packed=True)
    # the reference: the B=2 micro-batches one by one through the ordinary loss (no scan), with
    # the router losses and without (the same weights: the LM part alone)
    mesh = tm.make_mesh("expert=-1")
    graphdef, state, tx, rules = train_step.init_state(cfg, _tc(b), mesh)
    lm_cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    lm_graphdef = train_step.init_state(lm_cfg, _tc(b), mesh)[0]
    vg = lambda g: jax.jit(jax.value_and_grad(train_step.make_loss(g, packed=True), has_aux=True))
    full, lm_only = vg(graphdef), vg(lm_graphdef)
    ids = NamedSharding(mesh, rules.fit((b, S), "batch", "seq"))
    micro = [
        data_mod.Batch(*(None if x is None else x[i * b : (i + 1) * b] for x in rows))
        for i in range(n)
    ]
    w_total = sum(_target_weight(mb) for mb in micro)
    total, aux_losses = None, []
    for mb in micro:
        put = accumulate.put_batch(mb, ids, (b, S))
        (_, (_, aux)), g_full = full(state.params, state.rest, put)
        _, g_lm = lm_only(state.params, state.rest, put)
        w = _target_weight(mb) / w_total  # the LM part by token weights, the router part 1/N
        part = jax.tree.map(lambda f, m, w=w: w * m + (f - m) / n, g_full, g_lm)
        total = part if total is None else jax.tree.map(jnp.add, total, part)
        aux_losses.append(float(aux.aux_loss))
    updates, _ = tx.update(total, state.opt_state, state.params)
    want = jax.device_get(optax.apply_updates(state.params, updates))
    _assert_update_close(s0.params, want, s_acc.params)
    assert float(m_acc.aux_loss) == pytest.approx(np.mean(aux_losses), rel=1e-6)
    # batch_size=8's step (the aux loss of the whole batch's routing) is another
    _, (s8, m8) = _train(cfg, 8, 1, [rows], packed=True)
    assert float(m8.lm_loss) == pytest.approx(float(m_acc.lm_loss), rel=1e-6)
    assert abs(float(m8.aux_loss) - float(m_acc.aux_loss)) > 1e-4
    assert max(_rel(x, y) for x, y in zip(_leaves(s8.params), _leaves(s_acc.params))) > 1e-4


def test_micro_batches_are_consecutive_rows_of_the_global_batch():
    """Micro-batch n of a step's [N, B, S] batch is rows n*B .. n*B+B-1 of its global batch, each
    device holding its shard of every micro-batch; a process's rows in any order land right."""
    mesh = tm.make_mesh("data=2,expert=4")
    ids = NamedSharding(mesh, jax.P(("data", "expert"), None))
    sharding, shape = accumulate.step_batch(ids, 8, S, 3)
    assert shape == (3, 8, S) and sharding.spec == jax.P(None, ("data", "expert"), None)
    rows = np.arange(24 * S, dtype=np.int32).reshape(24, S)
    got = accumulate.put_batch(data_mod.Batch(rows), sharding, shape).tokens
    np.testing.assert_array_equal(np.asarray(got), rows.reshape(3, 8, S))
    for shard in got.addressable_shards:  # one row of each micro-batch per device
        assert shard.data.shape == (3, 1, S)
    order = [int(r) for r in np.random.default_rng(0).permutation(24)]
    mixed = accumulate.put_batch(data_mod.Batch(rows[order]), sharding, shape, rows=order)
    np.testing.assert_array_equal(np.asarray(mixed.tokens), rows.reshape(3, 8, S))
    assert accumulate.rows_of_process(sharding, shape) == list(range(24))


# --------------------------------------------------------------------------- the trainer

TRAIN = ["--config", "configs/tiny.yaml", "--quiet", f"seq_len={S}", "schedule_steps=10"]


def _metrics(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _meta(out, step: int) -> dict:
    return json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def test_trainer_accumulates_resumes_and_refuses_a_change(tmp_path):
    accum = [*TRAIN, "batch_size=2", "grad_accum=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli.main([*accum, "--steps", "3", "--out", str(whole)]) == 0
    assert cli.main([*accum, "--steps", "2", "--out", str(cut)]) == 0
    assert _meta(cut, 2)["data_position"] == 2 * 2 * 2  # rows: optimizer steps x 4
    assert cli.main([*accum, "--steps", "3", "--out", str(cut)]) == 0
    assert _metrics(cut) == _metrics(whole)  # bitwise: the same floats
    assert [m["step"] for m in _metrics(whole)] == [1, 2, 3]  # one line per optimizer step
    # the same rows as batch_size=4, in the same order: the same losses
    four = tmp_path / "four"
    assert cli.main([*TRAIN, "batch_size=4", "--steps", "3", "--out", str(four)]) == 0
    for a, b in zip(_metrics(whole), _metrics(four)):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-6)
    # grad_accum changes the math (the aux loss's averaging, the rows per step)
    with pytest.raises(identity.ResumeRefusedError, match=r"grad_accum 2 -> 4 would change"):
        cli.main([*TRAIN, "batch_size=2", "grad_accum=4", "--steps", "4", "--out", str(cut)])


def test_progress_line_shows_tokens_per_optimizer_step(tmp_path, capsys):
    argv = [a for a in TRAIN if a != "--quiet"]
    out = tmp_path / "run"
    assert cli.main([*argv, "batch_size=2", "grad_accum=2", "--steps", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("grad_accum 2 (4 rows, 64 tokens per optimizer step)" in x for x in lines)
    assert any(" 64 tok/step " in x and "step 1/1" in x for x in lines)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_grad_accum_below_1_is_refused(tmp_path, value):
    with pytest.raises(ValueError) as e:
        cli.parse([*TRAIN, "--steps", "1", "--out", str(tmp_path / "x"), f"grad_accum={value}"])
    assert str(e.value) == (
        f"trainer option grad_accum={value}: expected >= 1 (micro-batches per optimizer step)"
    )


def test_two_processes_read_their_rows_of_every_micro_batch(tmp_path):
    """Two processes of 4 devices (`test_multihost.py`'s set-up) with grad_accum=2 train as one
    process of 8: each reads, of every micro-batch, the rows its devices hold."""
    from test_multihost import _rows as row_set
    from test_multihost import run_two_and_one

    args = ["--data", str(word_corpus(tmp_path, 400)), "mesh=node=2,expert=4", "grad_accum=2"]
    multi, single = run_two_and_one(tmp_path, [*args, "--steps", "2"])
    read = {}
    for name in ("p0", "p1", "single"):
        (found,) = re.findall(
            r"reads (\d+) of the 16 rows of each batch: ([\d, -]+)",
            (tmp_path / f"{name}.err").read_text(),
        )
        read[name] = row_set(found[1])
    assert read["single"] == set(range(16)) and read["p0"] | read["p1"] == read["single"]
    for name in ("p0", "p1"):  # 4 rows of each micro-batch of 8, the same ones in both
        first = {r for r in read[name] if r < 8}
        assert len(first) == 4 and read[name] == first | {r + 8 for r in first}
    got, want = _metrics(multi), _metrics(single)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


# --------------------------------------------------------------------------- memory


def test_peak_is_one_micro_batch_plus_the_accumulator():
    """Temporaries of the grad_accum=4 step (micro-batch 8) against the batch 32 and 8 steps
    (compile only): below batch 32's, and at most batch 8's plus the float32 accumulator (the
    parameters' device shards) plus 5% of batch 8's (the per-micro-batch losses, the step's
    target count, the scan's bookkeeping)."""
    cfg = load_config("configs/tiny.yaml")
    temp = {}
    for b, n in [(8, 1), (32, 1), (8, 4)]:
        tc = TrainConfig(batch_size=b, grad_accum=n, seq_len=64)
        mesh = tm.make_mesh(tc.mesh)
        compiled = train_step.compile_abstract(cfg, tc, mesh, memo=False)
        temp[b, n] = compiled.memory_analysis().temp_size_in_bytes
    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    shard = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * 4  # float32
    accumulator = sum(shard(x) for x in jax.tree.leaves(state.params))
    assert temp[8, 4] < temp[32, 1]
    assert temp[8, 4] <= temp[8, 1] + accumulator + 0.05 * temp[8, 1], (temp, accumulator)
    assert temp[8, 4] >= temp[8, 1] + accumulator * 0.9  # the accumulator is really there
