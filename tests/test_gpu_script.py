"""benchmarks/gpu.py runs end to end on CPU (--tiny --interpret), so the GPU script does not rot.

The kernels run in their interpreters (Pallas interpret=True, Mosaic GPU under
force_gpu_interpret_mode) and the layer with gmm_impl="pallas-interpret", on a 1-device mesh.
"""

import math
import re

import pytest

from relaymoe_jax.kernels.gmm import MOE_IMPLS
from scripts import load_script


@pytest.fixture(scope="module")
def gpu():
    return load_script("benchmarks/gpu.py", "gpu_bench")


def _table(lines, first_col):
    """Holds the rows (dicts keyed by the header) of the table whose header starts so."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_col} |"))
    cols = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))))
    return rows


def _finite(text):
    value = float(text.replace(",", ""))
    return math.isfinite(value) and value >= 0


def test_tiny_interpret_run(gpu, capsys):
    gpu.main(["--tiny", "--interpret"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# reproduce: python benchmarks/gpu.py --tiny --interpret"
    assert out[1].startswith("# jax ") and "device: " in out[1]
    assert re.search(r"\d{4}-\d{2}-\d{2}", out[1])
    assert not any("section failed" in ln for ln in out), out

    kern = _table(out, "shape")
    cases = {(r["shape"], r["groups"]) for r in kern}
    assert len(cases) == len(gpu.TINY_SHAPES) * len(gpu.PATTERNS)
    assert {g.split(" ")[0] for _, g in cases} == {"balanced", "skewed"}
    for kernel, per_case in (("pallas", len(gpu.TINY_PALLAS_CONFIGS)), ("ragged_dot", 1)):
        rows = [r for r in kern if r["kernel"] == kernel]
        assert len(rows) == per_case * len(cases), kernel
        for r in rows:
            assert _finite(r["fwd ms"]) and _finite(r["fwd+bwd ms"]), r
            assert _finite(r["fwd TFLOP/s"]) and _finite(r["fwd+bwd TFLOP/s"]), r
            assert float(r["err fwd"]) <= gpu.TOL and float(r["err bwd"]) <= gpu.TOL, r
            assert r["check"] == "ok", r
    mgpu = [r for r in kern if r["kernel"] == "mgpu"]
    assert {(r["shape"], r["groups"]) for r in mgpu} == cases
    for r in mgpu:   # a number (then within tolerance) or the reason it could not run
        for col, err in (("fwd ms", "err fwd"), ("fwd+bwd ms", "err bwd")):
            if r[col].startswith("n/a: "):
                continue
            assert _finite(r[col]) and float(r[err]) <= gpu.TOL, r

    head = next(ln for ln in out if ln.startswith("## MoE layer"))
    impl = "pallas-interpret" if "pallas-interpret" in MOE_IMPLS else "xla"
    assert f"gmm_impl={impl!r}" in head
    layer = {r["variant"]: r for r in _table(out, "variant")}
    assert set(layer) == {"ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0"}
    for r in layer.values():
        assert float(r["fwd temp MiB"]) > 0 and float(r["fwd+bwd temp MiB"]) > 0, r
        assert r["run peak MiB"] == "n/a" or _finite(r["run peak MiB"].removeprefix("<= ")), r
        assert _finite(r["fwd+bwd ms"]) and int(r["dropped pairs"]) >= 0, r
    for v in ("ring-expert", "ring-token", "a2a-dropless"):   # dropless: the same y (bf16)
        assert int(layer[v]["dropped pairs"]) == 0
        assert float(layer[v]["y rel. diff vs ring-expert"]) <= gpu.TOL


def test_cpu_without_interpret_says_gpu_needed(gpu):
    with pytest.raises(SystemExit, match=r"needs a GPU.*--tiny --interpret"):
        gpu.main(["--tiny"])


def test_interpret_needs_tiny(gpu, capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--interpret"])
    assert "add --tiny" in capsys.readouterr().err
