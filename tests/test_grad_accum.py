"""Gradient accumulation, `grad_accum=N` (`train/step/accumulate.py`).

- One and two optimizer steps of grad_accum=4, batch_size=8 equal those of batch_size=32 (the
  same rows: packed documents of a multi-document corpus, read by the trainer's loader), with the
  router's aux loss off and the aux-loss-free expert bias on: losses, gradient norm, expert load
  and bias exactly, the parameters (float32, 1e-6 relative); and the summed gradient itself of
  grad_accum=4, batch_size=2 equals batch_size=8's.
- With the aux loss (and the z-loss) on, the step equals an independent reference: each
  micro-batch's gradients by the ordinary batch_size=2 loss (no scan), combined as documented (LM
  part by token weights, router part 1/N each), then one AdamW update; and that differs from
  batch_size=8 (the aux loss is averaged per micro-batch, not computed on the whole batch).
- The trainer runs grad_accum=4 (reading the rows batch_size=32 reads), resumes bitwise, refuses
  a resume that changes grad_accum, and refuses grad_accum=0 in one line (its runs, shared:
  `accum_runs`, train the first point's programs); two processes of 4 devices with grad_accum=2,
  each reading its rows of every micro-batch, train as one process of 8: tests/test_multihost.py.
- The accumulated step's temporaries are one micro-batch's plus the float32 accumulator (the
  first point's programs again).

The model is the tiny config with one layer (`num_hidden_layers=1`): each layer is the same
program, and one already drops, duplicates or misweights a (token, expert) pair visibly; the
compiled programs are built once per module and shared by the tests (`vg`, `accum_runs`, the
memoised steps of `_setup`).

Why the parameters are compared to 1e-6 where the gradient is >= 1e-5 (about 80% of them here):
AdamW's first update of an element is lr * g / (|g| + 1e-8), whose derivative in g is large
where |g| is small; float32 summation order changes g by up to ~1e-8 (absolute), which moves
the update of an element with |g| ~ 1e-8 by O(lr). The summed gradient itself is compared to
1e-6 (`test_summed_gradient_equals_one_batch`).
"""

import contextlib
import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from corpora import word_corpus
from jax.sharding import NamedSharding

from relaymoe_jax.models.config_files import load_config
from relaymoe_jax.models.loss import DEFAULT_CHUNK
from train import cli
from train import data as data_mod
from train.settings import TrainConfig
from train.state import identity
from train.step import accumulate, objective, train_step
from train.step import mesh as tm

S = 32
LR = 3e-3
HORIZON = 10  # the cosine's horizon, fixed: the trainer's runs of 1 and 2 steps share one step
TIMING = ("tokens_per_s", "step_time", "data_time", "model_tflops_per_device", "mfu")


def _cfg(**over):
    """The tiny config with one layer, the ring dispatcher (dropless)."""
    tiny = load_config("configs/tiny.yaml")
    return tiny.replace(dispatcher="ring", num_hidden_layers=1, **over)


def _tc(b: int, n: int = 1) -> TrainConfig:
    return TrainConfig(
        batch_size=b,
        grad_accum=n,
        seq_len=S,
        lr=LR,
        warmup_steps=0,
        weight_decay=0.0,
        schedule_steps=HORIZON,
    )


def _setup(cfg, b: int, n: int, packed: bool):
    """(graphdef, initial state, tx, compiled step, its batch sharding and shape); the step
    compiled as the trainer compiles it, memoised by its key (`train_step.compile_abstract`
    finds it: `test_peak_is_one_micro_batch_plus_the_accumulator`)."""
    tc = _tc(b, n)
    mesh = tm.make_mesh(tc.mesh)
    graphdef, state, tx, rules = train_step.init_state(cfg, tc, mesh)
    ids = NamedSharding(mesh, rules.fit((b, S), "batch", "seq"))
    sharding, shape = accumulate.step_batch(ids, b, S, n)
    step = train_step.make_step(
        graphdef, tx, tc.compute_dtype, tc.loss_chunk, packed=packed, grad_accum=n
    )
    key = train_step.step_key(cfg, tc, shape, mesh, packed)
    compiled = train_step.compile_step(step, state, sharding, shape, key=key, packed=packed)
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


def _rows(ds, steps: int, rows: int):
    """The first `steps` global batches of `rows` rows the trainer's loader reads from `ds`."""
    source = data_mod.make_source(
        [str(ds)], synthetic=False, seq_len=S, batch_size=rows, seed=0, vocab_size=256
    )
    assert source.packed  # several documents per row: segment ids
    return [next(source) for _ in range(steps)]


@pytest.fixture(scope="module")
def packed_rows(tmp_path_factory):
    """Two global batches of 32 rows (the tests of one step of 8 rows take the first 8)."""
    return _rows(word_corpus(tmp_path_factory.mktemp("docs"), 200, max_words=6), 2, 32)


@pytest.fixture(scope="module")
def vg():
    """vg(cfg) -> (jitted value_and_grad of the ordinary packed loss, no scan; its graphdef, the
    initial state, tx, rules, mesh at batch_size=2), built once per cfg for the module (jax
    compiles it once per batch shape)."""
    built = {}

    def get(cfg):
        if cfg not in built:
            mesh = tm.make_mesh("expert=-1")
            graphdef, state, tx, rules = train_step.init_state(cfg, _tc(2), mesh)
            loss = objective.make_loss(graphdef, jnp.float32, DEFAULT_CHUNK, packed=True)
            fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
            built[cfg] = fn, (graphdef, state, tx, rules, mesh)
        return built[cfg]

    return get


def _micro(rows, n: int, b: int):
    """The n micro-batches of b rows of a global batch (numpy), in order."""
    return [
        data_mod.Batch(*(None if x is None else x[i * b : (i + 1) * b] for x in rows))
        for i in range(n)
    ]


def test_accumulated_steps_equal_one_batch(packed_rows):
    """Micro-batches of 8 rows, one per device (a micro-batch of 2 would be replicated: the memory
    test reads these programs)."""
    cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0, expert_bias=True)
    ref = _train(cfg, 32, 1, packed_rows, packed=True)
    acc = _train(cfg, 8, 4, packed_rows, packed=True)
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


def test_summed_gradient_equals_one_batch(packed_rows, vg):
    """The grad_accum=4 gradient of 4 micro-batches of 2 rows (the scan) equals the gradient of
    their batch of 8 (float32, 1e-6): the ordinary loss's gradients of the micro-batches one by
    one, combined by their target counts (the batch's mean is over its targets, so this is the
    batch of 8's gradient), and the loss is the batch's mean."""
    cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    one, (graphdef, state, _, rules, mesh) = vg(cfg)
    summed = jax.jit(accumulate.accumulated_value_and_grad(graphdef, jnp.float32, 1024, True, 4))
    ids2 = NamedSharding(mesh, rules.fit((2, S), "batch", "seq"))
    sharding, shape = accumulate.step_batch(ids2, 2, S, 4)
    (b,) = _micro(packed_rows[0], 1, 8)  # its first 8 rows
    micro = _micro(b, 4, 2)
    w = np.array([_target_weight(mb) for mb in micro]) / _target_weight(b)
    assert len(set(w)) > 1  # the micro-batches weigh differently: a plain mean would be off
    lm1, parts = 0.0, []
    for wi, mb in zip(w, micro):
        (_, (lm, _)), g = one(state.params, state.rest, accumulate.put_batch(mb, ids2, (2, S)))
        lm1 += wi * float(lm)
        parts.append(g)
    g1 = _weighted_sum(parts, [float(wi) for wi in w])
    batch = accumulate.put_batch(b, sharding, shape)
    (_, (lm4, _)), g4 = summed(state.params, state.rest, batch)
    assert float(lm4) == pytest.approx(lm1, rel=1e-6)
    for x, y in zip(_leaves(g4), _leaves(g1)):
        assert x.dtype == np.float32 and _rel(x, y) < 1e-6


@jax.jit
def _weighted_sum(trees, weights):
    """sum_i weights[i] * trees[i], leaf by leaf, as one program (the weights traced: one
    compile for every call with the same trees' shapes)."""
    return jax.tree.map(lambda *xs: sum(w * x for w, x in zip(weights, xs)), *trees)


@jax.jit
def _router_combination(fulls, lms, weights):
    """sum_i weights[i] * lms[i] + (fulls[i] - lms[i]) / N, leaf by leaf, as one program (op by
    op, every leaf shape of every operation compiled a program of its own)."""
    n = len(fulls)

    def leaf(*xs):
        return sum(w * m + (f - m) / n for w, f, m in zip(weights, xs[:n], xs[n:]))

    return jax.tree.map(leaf, *fulls, *lms)


def _apply(tx):
    """params after `tx`'s update with the gradient, as one program."""
    return jax.jit(lambda g, opt, params: optax.apply_updates(params, tx.update(g, opt, params)[0]))


def _target_weight(batch) -> float:
    """The targets of rows (numpy): each position but the last, within one document."""
    seg = np.asarray(batch.segment_ids)
    return float(np.sum((seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1])))


def test_aux_loss_is_averaged_per_micro_batch(packed_rows, vg):
    """The accumulated step with the aux and z losses on equals the documented combination of
    per-micro-batch gradients of the ordinary step's loss, and not batch_size=8's (that one the
    ordinary loss's gradient of the 8 rows and the same update: it ran the trainer's batch_size=8
    step before, which computes the same, as `test_accumulated_steps_equal_one_batch` shows for
    batch_size=32)."""
    n, b = 4, 2
    cfg = _cfg(router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    (rows,) = _micro(packed_rows[0], 1, 8)  # its first 8 rows
    s0, (s_acc, m_acc) = _train(cfg, b, n, [rows], packed=True)
    # the reference: the B=2 micro-batches one by one through the ordinary loss (no scan), with
    # the router losses and without (the same weights: the LM part alone)
    full, (_, state, tx, rules, mesh) = vg(cfg)
    lm_only, _ = vg(_cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0))
    ids = NamedSharding(mesh, rules.fit((b, S), "batch", "seq"))
    micro = _micro(rows, n, b)
    w_total = sum(_target_weight(mb) for mb in micro)
    fulls, lms, ws, aux_losses = [], [], [], []
    for mb in micro:
        put = accumulate.put_batch(mb, ids, (b, S))
        (_, (_, aux)), g_full = full(state.params, state.rest, put)
        _, g_lm = lm_only(state.params, state.rest, put)
        fulls.append(g_full)
        lms.append(g_lm)
        ws.append(_target_weight(mb) / w_total)  # the LM part by token weights, the router 1/N
        aux_losses.append(float(aux.aux_loss))
    total = _router_combination(fulls, lms, ws)
    apply = _apply(tx)
    want = jax.device_get(apply(total, state.opt_state, state.params))
    _assert_update_close(s0.params, want, s_acc.params)
    assert float(m_acc.aux_loss) == pytest.approx(np.mean(aux_losses), rel=1e-6)
    # batch_size=8's step (the aux loss of the whole batch's routing) is another: the ordinary
    # loss's gradient of the whole batch and the same AdamW update (`apply`, compiled above),
    # which is batch_size=8's step without compiling that step
    ids8 = NamedSharding(mesh, rules.fit((n * b, S), "batch", "seq"))
    put8 = accumulate.put_batch(rows, ids8, (n * b, S))
    (_, (lm8, aux8)), g8 = full(state.params, state.rest, put8)
    s8 = jax.device_get(apply(g8, state.opt_state, state.params))
    assert float(lm8) == pytest.approx(float(m_acc.lm_loss), rel=1e-6)
    assert abs(float(aux8.aux_loss) - float(m_acc.aux_loss)) > 1e-4
    assert max(_rel(x, y) for x, y in zip(_leaves(s8), _leaves(s_acc.params))) > 1e-4


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

# the trainer's arguments for `_cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
# expert_bias=True)` and `_tc(8, 4)`: its runs train test_accumulated_steps_equal_one_batch's
# programs (memoised, `_setup`), with batch_size=32 and grad_accum=1 too; `accum_runs` adds --data
TRAIN = (
    f"--config configs/tiny.yaml --quiet seq_len={S} batch_size=8 grad_accum=4 num_hidden_layers=1 "
    f"dispatcher=ring router_aux_loss_coef=0.0 router_z_loss_coef=0.0 expert_bias=true lr={LR} "
    f"warmup_steps=0 weight_decay=0.0 schedule_steps={HORIZON}"
).split()


def _metrics(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _meta(out, step: int) -> dict:
    return json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())


@pytest.fixture(scope="module")
def accum_runs(tmp_path_factory):
    """The trainer with grad_accum=4 (8-row micro-batches, 32 rows per optimizer step) on a
    packed word corpus, in this process of 8 devices: 2 steps ("whole"), 1 step (its output
    printed: "cut_out") then resumed to 2 ("cut"), batch_size=32 without accumulation ("b32").
    Two steps show all they did with three before: the resume restores the step-1 state and
    data position and repeats step 2 bitwise, and step 2's loss depends on step 1's update.
    (Two processes with grad_accum=2, the aux loss on, against one: tests/test_multihost.py.)"""
    tmp = tmp_path_factory.mktemp("accum")
    args = [*TRAIN, "--data", str(word_corpus(tmp / "docs", 400))]
    whole, cut, b32 = tmp / "whole", tmp / "cut", tmp / "b32"
    assert cli.main([*args, "--steps", "2", "--out", str(whole)]) == 0
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        loud = [a for a in args if a != "--quiet"]
        assert cli.main([*loud, "--steps", "1", "--out", str(cut)]) == 0
    cut_position = _meta(cut, 1)["data_position"]
    assert cli.main([*args, "--steps", "2", "--out", str(cut)]) == 0
    single = [
        {"grad_accum=4": "grad_accum=1", "batch_size=8": "batch_size=32"}.get(a, a) for a in args
    ]
    assert cli.main([*single, "--steps", "2", "--out", str(b32)]) == 0
    return dict(
        args=args,
        whole=whole,
        cut=cut,
        b32=b32,
        cut_position=cut_position,
        cut_out=printed.getvalue(),
    )


def test_trainer_accumulates_resumes_and_refuses_a_change(accum_runs):
    whole, cut = accum_runs["whole"], accum_runs["cut"]
    assert accum_runs["cut_position"] == 1 * 32  # rows: optimizer steps x 32
    assert _metrics(cut) == _metrics(whole)  # bitwise: the same floats
    assert [m["step"] for m in _metrics(whole)] == [1, 2]  # one line per optimizer step
    # the same rows as batch_size=32, in the same order: the same losses
    for a, b in zip(_metrics(whole), _metrics(accum_runs["b32"]), strict=True):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-6)
    # grad_accum changes the math (the aux loss's averaging, the rows per step)
    argv = [{"grad_accum=4": "grad_accum=2"}.get(a, a) for a in accum_runs["args"]]
    with pytest.raises(identity.ResumeRefusedError, match=r"grad_accum 4 -> 2 would change"):
        cli.main([*argv, "--steps", "3", "--out", str(cut)])


def test_progress_line_shows_tokens_per_optimizer_step(accum_runs):
    """The output of `accum_runs`' first "cut" run (1 step, without --quiet)."""
    lines = accum_runs["cut_out"].splitlines()
    assert any("grad_accum 4 (32 rows, 1,024 tokens per optimizer step)" in x for x in lines)
    assert any(" 1,024 tok/step " in x and "step 1/1" in x for x in lines)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_grad_accum_below_1_is_refused(tmp_path, value):
    argv = ["--config", "configs/tiny.yaml", "--steps", "1", "--out", str(tmp_path / "x")]
    with pytest.raises(ValueError) as e:
        cli.parse([*argv, f"grad_accum={value}"])
    assert str(e.value) == (
        f"trainer option grad_accum={value}: expected >= 1 (micro-batches per optimizer step)"
    )


# --------------------------------------------------------------------------- memory


def test_peak_is_one_micro_batch_plus_the_accumulator():
    """Temporaries of the grad_accum=4 step (micro-batch 8) against the batch 32 and 8 steps:
    below batch 32's, and at most batch 8's plus the float32 accumulator (the parameters' device
    shards) plus 5% of batch 8's (the per-micro-batch losses, the step's target count, the
    scan's bookkeeping). The grad_accum=4 and batch 32 steps are the programs
    `test_accumulated_steps_equal_one_batch` ran (memoised by `_setup`; compiled here when it
    did not run first), the batch 8 step is compiled only."""
    cfg = _cfg(router_aux_loss_coef=0.0, router_z_loss_coef=0.0, expert_bias=True)
    temp = {}
    for b, n in [(8, 1), (32, 1), (8, 4)]:
        tc = _tc(b, n)
        mesh = tm.make_mesh(tc.mesh)
        compiled = train_step.compile_abstract(cfg, tc, mesh, packed=True)
        temp[b, n] = compiled.memory_analysis().temp_size_in_bytes
    _, state, _, _ = train_step.abstract_state(cfg, tc, mesh)
    shard = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * 4  # float32
    accumulator = sum(shard(x) for x in jax.tree.leaves(state.params))
    assert temp[8, 4] < temp[32, 1]
    assert temp[8, 4] <= temp[8, 1] + accumulator + 0.05 * temp[8, 1], (temp, accumulator)
    assert temp[8, 4] >= temp[8, 1] + accumulator * 0.9  # the accumulator is really there
