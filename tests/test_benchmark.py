"""The benchmark script runs end to end (tiny shape) and its ring-traffic columns are consistent."""

import pytest

from scripts import load_script


@pytest.fixture(scope="module")
def table():
    return load_script("benchmarks/moe_layer.py", "moe_layer_bench")


def test_tiny_table_with_time(table, capsys):
    table.main(["-E", "16", "-k", "2", "-H", "32", "-F", "32", "-T", "64", "--time", "--runs", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# reproduce: python ") and "-E 16" in out[0]
    head = next(line for line in out if line.startswith("| E |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    rows = {r["variant"]: r for r in (dict(zip(cols, (c.strip() for c in line.strip("|").split(
        "|")))) for line in out if line.startswith("| 16 |"))}
    assert set(rows) == {"ring-expert", "ring-token", "a2a-dropless", "a2a-cap1.0"}
    # float32: what the expert ring sends forward is exactly Table 2's E/EP * W.
    assert rows["ring-expert"]["hop fwd KiB"] == rows["ring-expert"]["Table 2 fwd"]
    expert_kib = 16 // 8 * 3 * 32 * 32 * 4 / 1024
    assert float(rows["ring-expert"]["Table 2 fwd"]) == expert_kib
    auto = next(line for line in out if line.startswith("- E16 k2") and "auto picks" in line)
    picked = "ring-token" if "'token'" in auto else "ring-expert"
    assert rows[picked]["x auto"] == "1.00" and rows[picked]["time x auto"] == "1.00"
    assert all(float(r["fwd+bwd ms"].replace(",", "")) > 0 for r in rows.values())
