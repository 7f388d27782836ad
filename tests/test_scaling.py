"""benchmarks/scaling.py on a tiny shape over 2 hosts x 8 abstract H100s (XLA:GPU, deviceless):
its JSON's cross-host bytes against bytes computed here from the shapes.

The grouped matmul is XLA's (`--gmm xla`): what the collectives send does not depend on it (the
default, our Mosaic GPU kernels, gave the same bytes in every column, temporaries aside), and
the six programs compile in less time without the kernels (tests/test_gpu_compile.py compiles
the ring with them)."""

import json

import pytest

from relaymoe_jax.analysis import gpu_mesh
from scripts import load_script

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(
        not gpu_mesh.plugin_available(), reason="needs the gpu-compile extra (jax CUDA plugin)"
    ),
]
scaling = load_script("benchmarks/scaling.py", "scaling")
E, K, H, F, T, EP = 16, 2, 64, 32, 256, 16
HOSTS, LOCAL = 2, 8
BOUNDARY = {LOCAL - 1, 2 * LOCAL - 1}  # local index 7: the flat ring's hop to the next host
HIER = scaling.has_ring_option()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    variants = ["ring-expert", "a2a-cap1.0"] + (["hier-expert"] if HIER else [])
    scaling.main(
        [
            "--ep",
            str(EP),
            "-E",
            str(E),
            "-k",
            str(K),
            "-H",
            str(H),
            "-F",
            str(F),
            "-T",
            str(T),
            "--variants",
            *variants,
            "--gmm",
            "xla",
            "--json",
            str(out),
        ]
    )
    record = json.loads(out.read_text())
    assert record["command"].startswith("python ") and record["target"] == "h100"
    return {r["variant"]: r for r in record["rows"]}


def test_flat_ring_crosses_hosts_at_the_boundary_only(rows):
    r = rows["ring-expert"]
    partition = E // EP * 3 * H * F * 2  # one GPU's experts, bf16: what one hop sends
    sent = (EP - 1) * partition  # forward: EP - 1 hops, to the next GPU
    assert r["hop_fwd"] == partition
    for i in range(EP):
        # the next GPU is on another host at local index 7 only
        assert (r["fwd_permute_inter"][i], r["fwd_permute_intra"][i]) == (
            (sent, 0) if i in BOUNDARY else (0, sent)
        )
        # fwd+bwd: every GPU sends the same bytes to its ring neighbour, more than the forward
        assert r["fwdbwd_permute_inter"][i] == (r["intra"][0] if i in BOUNDARY else 0)
        assert r["inter"][i] == r["fwdbwd_permute_inter"][i]
    assert r["intra"][0] > sent
    assert r["fwdbwd_a2a_inter"] == [0] * EP


def test_all_to_all_sends_half_across(rows):
    """Capacity 1.0: each of the forward's two all-to-alls (dispatch, combine) moves E x
    ceil(T*k/E) rows of H bf16 per GPU, 1/EP of it to each GPU: 8 of 16 on the other host."""
    r = rows["a2a-cap1.0"]
    buffer = E * -(-T * K // E) * H * 2
    across = 2 * buffer * LOCAL // EP  # the other host's 8 slices of both
    for i in range(EP):
        assert across <= r["fwd_a2a_inter"][i] <= across + E * 4  # + per-expert counts, int32
        assert r["fwdbwd_a2a_inter"][i] * (LOCAL - 1) == r["fwdbwd_a2a_intra"][i] * LOCAL
    assert r["fwdbwd_permute_inter"] == r["fwd_permute_intra"] == [0] * EP
    assert r["fwdbwd"] > rows["ring-expert"]["fwdbwd"]


@pytest.mark.skipif(not HIER, reason="moe_ffn has no ring= option yet")
def test_hierarchical_ring_sends_one_partition_across_per_round(rows):
    """The hierarchical ring: every GPU sends its partition across hosts once per node round,
    HOSTS - 1 partitions forward, where the flat ring leaves that to the 2 boundary GPUs."""
    r = rows["hier-expert"]
    partition = E // EP * 3 * H * F * 2
    assert r["fwd_permute_inter"] == [(HOSTS - 1) * partition] * EP
    assert max(r["inter"]) < max(rows["ring-expert"]["inter"])
    # the "hidden hops" column: its cross-host transfers run beside a whole round (8 hops), the
    # flat ring's beside one
    assert scaling.hidden_hops(r) == str(LOCAL) and scaling.hidden_hops(rows["ring-expert"]) == "1"
    assert scaling.hidden_hops(rows["a2a-cap1.0"]) == "-"


@pytest.mark.parametrize(
    "argv",
    [
        ["--ep", "12"],
        ["--ep", "16", "-E", "24"],
        ["--ep", "0"],
        ["-k", "200"],
        ["--variants", "ring"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        scaling.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
