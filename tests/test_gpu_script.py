"""benchmarks/gpu.py runs end to end on CPU (--tiny --interpret), so the GPU script does not rot.

The kernels run in their interpreters (Pallas interpret=True, Mosaic GPU under
force_gpu_interpret_mode) in the kernel section, and the hop with "pallas-interpret" (the Mosaic GPU
kernel's ring hops: tests/test_dispatch_mosaic.py), its FP8 row with "xla" (the row's plumbing:
tests/test_fp8_op.py checks the FP8 hop's numbers); the layer runs with gmm_impl="xla". On a
1-device mesh. One run (module fixture) feeds every check, its `--json` file included, which the
cost model's loader must read back.

The grouped-matmul section runs at one of the script's three tiny kernel shapes (its first,
`gpu.TINY_SHAPES[:1]`, set for this module): every kernel, pass and group pattern (balanced, and
skewed with empty groups) still runs and is checked against the float64 reference; the other two
shapes differed only in K, N and G, and each cost a compile of every kernel's three passes and
two runs of the Mosaic GPU interpreter per pass and pattern.

Three more cuts, set by the `gpu` fixture, halve what the interpreters run without changing
what a row checks: that shape has M=128 rows (the script's 256; the balanced groups are 32
rows, the skewed ones still have an empty group); the Pallas kernel runs one block config,
"16,32,32" (the script's `--pallas-configs` parsing and labels; its "default" is
`gmm(impl="pallas")`, which the kernel tests call); the attention section has N=2 query heads
over K=1 kv head (still grouped-query; the script's 4 over 2 ran twice the heads' blocks). Each
kernel, pass, pattern and attention case still runs and is checked against its reference.
"""

import contextlib
import io
import json
import math
import re
import sys

import jax
import pytest
from flax import nnx

from relaymoe_jax.analysis import costmodel as cm
from scripts import load_script


@pytest.fixture(scope="module")
def gpu():
    """The script, with its tiny kernel and attention shapes and Pallas configs cut (see the
    module doc) for this module: the sections' modules are shared by the process, so they are
    put back afterwards."""
    script = load_script("benchmarks/gpu.py", "gpu_bench")
    name, _, k, n, g = script.TINY_SHAPES[0]
    attn = dict(script.TINY_ATTN, heads=2, kv_heads=1)
    with pytest.MonkeyPatch.context() as mp:
        for mod in (script, sys.modules["gpu_kernel_section"]):
            mp.setattr(mod, "TINY_SHAPES", [(name, 128, k, n, g)])
        for mod in (script, sys.modules["gpu_attention"]):
            mp.setattr(mod, "TINY_ATTN", attn)
        mp.setattr(script, "TINY_PALLAS_CONFIGS", ["16,32,32"])
        yield script


@pytest.fixture(scope="module")
def run(gpu, tmp_path_factory):
    """(printed lines, the --json path) of one `--tiny --interpret --json PATH` run."""
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu.main(["--tiny", "--interpret", "--json", str(path)])
    return out.getvalue().splitlines(), path


def _table(lines, first_col, section="#"):
    """Holds the rows (dicts keyed by the header) of the first table whose header starts so after
    the line that starts with `section`."""
    after = next(i for i, ln in enumerate(lines) if ln.startswith(section))
    start = next(i for i, ln in enumerate(lines) if i > after and ln.startswith(f"| {first_col} |"))
    cols = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))))
    return rows


def _finite(text):
    value = float(text.replace(",", ""))
    return math.isfinite(value) and value >= 0


def test_header(run):
    out, path = run
    assert out[0] == f"# reproduce: python benchmarks/gpu.py --tiny --interpret --json {path}"
    assert out[1].startswith("# jax ") and "device: " in out[1]
    assert re.search(r"\d{4}-\d{2}-\d{2}", out[1])
    assert not any("section failed" in ln for ln in out), out
    assert out[-1] == f"# measurements written to {path}"


def test_kernel_table(gpu, run):
    kern = _table(run[0], "shape")
    cases = {(r["shape"], r["groups"]) for r in kern}
    assert len(cases) == len(gpu.TINY_SHAPES) * len(gpu.PATTERNS)
    assert {g.split(" ")[0] for _, g in cases} == {"balanced", "skewed"}
    per_kernel = (("mosaic", 1), ("pallas", len(gpu.TINY_PALLAS_CONFIGS)), ("ragged_dot", 1))
    for kernel, per_case in per_kernel:
        rows = [r for r in kern if r["kernel"] == kernel]
        assert len(rows) == per_case * len(cases), kernel
        for r in rows:
            for p in gpu.PASSES:
                assert _finite(r[f"{p} ms"]) and _finite(r[f"{p} TFLOP/s"]), (p, r)
                assert float(r[f"err {p}"]) <= gpu.TOL, (p, r)
            assert r["check"] == "ok", r
    fp8_rows = [r for r in kern if r["kernel"] == "mosaic-fp8"]  # the e4m3 kernel: fwd and dx
    assert len(fp8_rows) == len(cases)
    for r in fp8_rows:
        for p in ("fwd", "dx"):
            assert _finite(r[f"{p} ms"]) and float(r[f"err {p}"]) <= gpu.FP8_TOL, (p, r)
        assert r["dW ms"].startswith("n/a: 16-bit tgmm") and r["check"] == "ok", r
    mgpu = [r for r in kern if r["kernel"] == "mgpu"]
    assert {(r["shape"], r["groups"]) for r in mgpu} == cases
    for r in mgpu:  # a number (then within tolerance) or the reason it could not run
        for p in gpu.PASSES:
            if r[f"{p} ms"].startswith("n/a: "):
                continue
            assert _finite(r[f"{p} ms"]) and float(r[f"err {p}"]) <= gpu.TOL, r


def test_hop_table(gpu, run):
    out = run[0]
    head = next(ln for ln in out if ln.startswith("## One ring hop"))
    shp = gpu.TINY_HOP
    pairs = shp["tokens"] * shp["top_k"]
    assert f"{pairs:,} pairs" in head and f"E_l={shp['experts']}" in head
    rows = _table(out, "chunk (pairs)")
    share = pairs  # the balanced share of the paper-like ring: T*k / EP = tokens*k here
    assert head.endswith("(gmm_impl='auto' here: 'pallas-interpret')")
    assert [(r["chunk (pairs)"], r["gmm_impl"]) for r in rows] == [
        (f"{shp['chunk']} (default)", "pallas-interpret"),
        (f"{share} (balanced share)", "pallas-interpret"),
        (f"{shp['chunk']} (default)", "xla + expert_fp8"),
    ]
    assert [int(r["chunks per hop"]) for r in rows] == [
        pairs // shp["chunk"],
        1,
        pairs // shp["chunk"],
    ]
    hf = shp["hidden"] * shp["ffn"]
    for r in rows:
        fwd, bwd, both = (float(r[c]) for c in ("fwd ms", "bwd ms", "fwd+bwd ms"))
        # the printed times have 4 significant digits: each is off by up to 5e-4 of itself
        tol = 5e-4 * (abs(fwd) + abs(both) + abs(bwd))
        assert fwd > 0 and both > 0 and bwd == pytest.approx(both - fwd, abs=tol)
        assert float(r["fwd TFLOP/s"]) == pytest.approx(6 * pairs * hf / fwd / 1e9, rel=2e-3)
        if bwd <= 0:  # one interpreted run each: the noise can exceed the backward's time
            assert r["bwd TFLOP/s"] == "n/a (fwd+bwd <= fwd)", r
            continue
        assert float(r["bwd TFLOP/s"]) == pytest.approx(12 * pairs * hf / bwd / 1e9, rel=2e-3)


def test_layer_table(gpu, run):
    out = run[0]
    head = next(ln for ln in out if ln.startswith("## MoE layer"))
    assert "gmm_impl='xla'" in head  # the kernels' interpreters: the hop and kernel sections
    layer = {r["variant"]: r for r in _table(out, "variant")}
    assert set(layer) == {"ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0"}
    for r in layer.values():
        assert float(r["fwd temp MiB"]) > 0 and float(r["fwd+bwd temp MiB"]) > 0, r
        assert r["run peak MiB"] == "n/a" or _finite(r["run peak MiB"].removeprefix("<= ")), r
        assert _finite(r["fwd+bwd ms"]) and int(r["dropped pairs"]) >= 0, r
    for v in ("ring-expert", "ring-token", "a2a-dropless"):  # dropless: the same y (bf16)
        assert int(layer[v]["dropped pairs"]) == 0
        assert float(layer[v]["y rel. diff vs ring-expert"]) <= gpu.TOL


def test_attention_table(gpu, run):
    """Both impls at every tiny shape, plain causal and with documents; the kernel within the
    bf16 tolerance of the chunked path (o and the three gradients); the json holds the rows."""
    out, path = run
    shp = gpu.TINY_ATTN
    head = next(ln for ln in out if ln.startswith("## Attention"))
    assert f"N={shp['heads']} query heads, K={shp['kv_heads']} kv heads" in head
    rows = _table(out, "tokens", "## Attention")
    docs = ("none", f"{shp['doc']:,}")
    assert sorted((r["tokens"], r["documents"], r["impl"]) for r in rows) == sorted(
        (f"{s:,}", d, i) for s in shp["tokens"] for d in docs for i in ("pallas", "chunked")
    )
    n, d = shp["heads"], shp["head_dim"]
    for r in rows:
        s, doc = int(r["tokens"].replace(",", "")), r["documents"]
        full, rest = divmod(s, shp["doc"])  # the visible (query, key) pairs, causal
        docs_pairs = full * shp["doc"] * (shp["doc"] + 1) // 2 + rest * (rest + 1) // 2
        pairs = s * (s + 1) // 2 if doc == "none" else docs_pairs
        fwd, bwd = float(r["fwd ms"]), float(r["bwd ms"])  # bwd: a difference of two times
        assert fwd > 0 and math.isfinite(bwd), r
        assert float(r["fwd TFLOP/s"]) == pytest.approx(4 * n * d * pairs / fwd / 1e9, rel=2e-3)
        if bwd > 0:
            tf_b = 2.5 * 4 * n * d * pairs / bwd / 1e9
            assert float(r["bwd TFLOP/s"]) == pytest.approx(tf_b, rel=2e-3), r
        else:
            assert r["bwd TFLOP/s"] == "n/a (fwd+bwd <= fwd)", r
        if r["impl"] == "chunked":
            assert (r["err o / dq / dk / dv"], r["check"]) == ("reference", "-"), r
            continue
        errs = [float(e) for e in r["err o / dq / dk / dv"].split(" / ")]
        assert len(errs) == 4 and max(errs) <= gpu.TOL and r["check"] == "ok", r
    recs = json.loads(path.read_text())["attention"]
    assert len(recs) == len(rows)
    for rec, r in zip(recs, rows):
        assert (f"{rec['tokens']:,}", rec["impl"]) == (r["tokens"], r["impl"])
        assert rec["documents"] == (None if r["documents"] == "none" else shp["doc"])
        assert f"{rec['fwd_ms']:.4g}" == r["fwd ms"] and f"{rec['bwd_ms']:.4g}" == r["bwd ms"]
        assert rec["error"] is None and (rec["impl"] == "chunked") == (rec["err"] is None), rec
        assert rec["err"] is None or max(rec["err"]) <= gpu.TOL, rec


def test_train_step_table(gpu, run):
    """The trainer's step at each tiny length: its time, tokens/s and model TFLOP/s agree (the
    metrics line's FLOPs, `train.step.flops`, of the section's model), no MFU on CPU, the
    planner's prediction of the same step (`train.planner.predict`, all layers `full`) and the
    ratio; the json holds the rows."""
    from gpu_train import section_config, step_config

    from relaymoe_jax.models import QwenMoe
    from train.planner import predict
    from train.step import flops

    out, path = run
    shp, opts = gpu.TINY_TRAIN, gpu.parse_args(["--tiny", "--interpret"])
    rows = _table(out, "tokens", "## Train step")
    assert [r["tokens"] for r in rows] == [f"{t:,}" for t in shp["tokens"]]
    cfg = section_config(shp, opts)
    assert (cfg.num_hidden_layers, cfg.moe.num_experts, cfg.moe_remat) == (1, 8, True)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = nnx.state(nnx.eval_shape(lambda: QwenMoe(cfg, mesh=mesh, rngs=nnx.Rngs(0))), nnx.Param)
    rates = predict.Rates.load()
    recs = json.loads(path.read_text())["train"]
    assert len(recs) == len(rows)
    for r, rec, t in zip(rows, recs, shp["tokens"], strict=True):
        ms = float(r["step ms"])
        model = flops.StepFlops.of(cfg, params, "cpu").step(t, t * (t + 1) // 2)
        assert ms > 0 and float(r["tokens/s"]) == pytest.approx(t / ms * 1e3, rel=1e-3)
        assert float(r["model TFLOP/s"]) == pytest.approx(model / ms / 1e9, rel=1e-3)
        assert r["MFU"] == "n/a" and float(r["compiled peak MiB"].replace(",", "")) > 0
        tc = step_config(t, cfg, opts)
        want = predict.predict(cfg, tc, {"data": 1}, ("full",), params, "cpu", rates)
        assert float(r["predicted ms"]) == pytest.approx(want.seconds * 1e3, rel=1e-3)
        ratio = float(r["measured / predicted"])
        assert ratio == pytest.approx(ms / (want.seconds * 1e3), rel=1e-2)
        assert (
            rec["tokens"] == t and rec["error"] is None and f"{rec['step_ms']:.4g}" == r["step ms"]
        )


def test_json_has_the_printed_figures(gpu, run):
    out, path = run
    doc = json.loads(path.read_text())
    assert doc["command"] == out[0].removeprefix("# reproduce: ")
    assert doc["device"] in out[1] and doc["date"] in out[1] and doc["jax"] in out[1]
    assert doc["tiny"] is True and doc["interpret"] is True
    printed = _table(out, "shape")
    assert len(doc["kernels"]) == len(printed) * len(gpu.PASSES)
    first = printed[0]
    for p in gpu.PASSES:
        rec = next(r for r in doc["kernels"] if r["op"] == p)
        assert (rec["shape"], rec["kernel"], rec["config"]) == (first["shape"], "mosaic", "mosaic")
        assert f"{rec['ms']:.4g}" == first[f"{p} ms"]
        assert f"{rec['tflops']:.4g}" == first[f"{p} TFLOP/s"]
    hops = _table(out, "chunk (pairs)")
    label = lambda h: h["impl"] + (" + expert_fp8" if h["fp8"] else "")
    assert [(h["chunk"], h["default_chunk"], label(h)) for h in doc["hop"]] == [
        (int(r["chunk (pairs)"].split()[0].replace(",", "")), "default" in r["chunk (pairs)"], i)
        for r, i in ((r, r["gmm_impl"]) for r in hops)
    ]
    assert [h["fp8"] for h in doc["hop"]] == [False, False, True]
    assert [h["default_impl"] for h in doc["hop"]] == [
        h["impl"] == "pallas-interpret" for h in doc["hop"]
    ]
    for rec, r in zip(doc["hop"], hops):
        assert f"{rec['fwd_ms']:.4g}" == r["fwd ms"] and f"{rec['bwd_ms']:.4g}" == r["bwd ms"]
    assert [r["variant"] for r in doc["layer"]] == list(gpu.LAYER_VARIANTS)
    assert doc["layer"] == _table(out, "variant")


def test_cost_model_reads_the_json_back(gpu, run):
    out, path = run
    shp = gpu.TINY_HOP
    rates = cm.load_rates(path, hidden=shp["hidden"], ffn=shp["ffn"])
    default = _table(out, "chunk (pairs)")[0]  # the default chunk with auto's gmm_impl
    assert default["gmm_impl"] == "pallas-interpret" and "(default)" in default["chunk (pairs)"]
    assert rates.fwd.origin == "hop" and f"{rates.fwd.tflops:.4g}" == default["fwd TFLOP/s"]
    measured = [rates.fwd]
    if default["bwd TFLOP/s"].startswith("n/a"):  # no tiny kernel shape is H x F: assumed
        assert rates.bwd == cm.assumed_rate()
    else:
        assert rates.bwd.origin == "hop" and f"{rates.bwd.tflops:.4g}" == default["bwd TFLOP/s"]
        measured.append(rates.bwd)
    doc = json.loads(path.read_text())
    for r in measured:
        assert r.measured and r.source.startswith(
            f"measured ({path}, {doc['device']}, {doc['date']}"
        )
        assert "--interpret" in r.source and f"chunk {shp['chunk']}" in r.source
    # the attention rates: our kernel's plain causal row at the longest tiny length
    row = next(
        r
        for r in _table(out, "tokens", "## Attention")
        if (r["impl"], r["documents"]) == ("pallas", "none")
    )
    fwd, bwd = cm.load_attention_rates(path)
    if row["bwd TFLOP/s"].startswith("n/a"):  # no backward figure: the row is not taken
        assert fwd == bwd == cm.assumed_rate()
    else:
        assert f"{fwd.tflops:.4g}" == row["fwd TFLOP/s"] and fwd.origin == "attention"
        assert f"{bwd.tflops:.4g}" == row["bwd TFLOP/s"] and "--interpret" in bwd.source


def test_cpu_without_interpret_says_gpu_needed(gpu):
    with pytest.raises(SystemExit, match=r"needs a GPU.*--tiny --interpret"):
        gpu.main(["--tiny"])


def test_interpret_needs_tiny(gpu, capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--interpret"])
    assert "add --tiny" in capsys.readouterr().err


def test_a_train_length_the_budget_cannot_hold_is_skipped(gpu):
    """`gpu_train.skip_reason`, before a length is built: it needs the last length's compile
    (COMPILE_S before the first) plus warm-up + runs + 1 steps at its predicted step time scaled
    by the last length's measured / predicted; skipped when the budget left is less (the cell says
    both), and once the budget is spent; with --interpret nothing is estimated."""
    from gpu_common import Budget
    from gpu_train import COMPILE_S, Pace, skip_reason

    opts = gpu.parse_args([])  # 2 warm-ups and 10 runs: 13 steps
    pace = Pace(compile_s=30.0, ratio=2.0)  # needs 30 + 13 * 1.0 * 2 = 56 s
    assert skip_reason(1.0, pace, Budget(1.0), opts) is None  # 60 s left
    why = skip_reason(1.0, pace, Budget(0.9), opts)  # 54 s left
    assert re.fullmatch(r"skipped: needs ~56 s, 5[34] s of the budget left", why), why
    first = skip_reason(1.0, Pace(), Budget(COMPILE_S / 60), opts)  # COMPILE_S + 13 s
    assert first is not None and first.startswith(f"skipped: needs ~{COMPILE_S + 13:.0f} s"), first
    tiny = gpu.parse_args(["--tiny", "--interpret"])
    assert skip_reason(1e6, pace, Budget(0.01), tiny) is None
    assert skip_reason(1.0, pace, Budget(-1), tiny) == "skipped: time budget of -1 min reached"
