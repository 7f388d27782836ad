"""docs/swap-in.md runs as written: each section's Python blocks, in order, in a fresh namespace
(8 emulated devices; the parity checks inside them compare against the layer each swap
replaces, values and gradients, and the negative control proves the check can fail)."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "swap-in.md"


def sections():
    """{section title: its Python code blocks joined}, for the sections that have any."""
    out = {}
    for part in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
        if blocks:
            out[title.strip()] = "\n".join(blocks)
    return out


def test_the_doc_has_the_two_swaps_and_the_chex_section():
    assert list(sections()) == [
        "Swap 1: an existing shard_map expert step",
        "Swap 2: an NNX MoE layer",
        "Test your integration with chex",
    ]


@pytest.mark.parametrize("title", list(sections()))
def test_section_runs(title):
    code = sections()[title]
    assert "assert_moe_parity" in code  # every section checks something
    exec(compile(code, f"{DOC.name}: {title}", "exec"), {"__name__": "swap_in_doc"})
