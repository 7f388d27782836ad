"""Parameter counts of the model configurations, from the architecture formula.

`param_count(cfg)` counts a `ModelConfig`'s parameters by component, with the total and the
active counts; see its docstring for exactly what is counted.
`python -m relaymoe_jax.models.param_count [names or paths...]` prints a markdown table of every
config in `configs/` (or the ones named) with total and active counts, next to the "Params"
column of the paper's Table 3 where the config is one of its rows (`PAPER_PARAMS`).
"""

import argparse
import sys
from pathlib import Path

from relaymoe_jax.models.config import ModelConfig
from relaymoe_jax.models.config_files import available_configs, load_config, parse_overrides

# The paper's Table 3 "Params" column (RelayMoE paper, Table 3: "Model configurations used in
# evaluation"), keyed by our config name: (the paper's row name, its Params value). For the three
# production rows the value is the model's nominal size from its name. The scaling rows are
# approximate and not consistent among themselves: MoE-K4 (7.5B) and MoE-K8 (7.6B) have the same
# shapes (top-k adds no parameters). See tests/test_configs.py for what they match.
PAPER_PARAMS: dict[str, tuple[str, float]] = {
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 30e9),
    "qwen3.5-35b-a3b": ("Qwen3.5-35B-A3B", 35e9),
    "qwen2-57b-a14b": ("Qwen2-57B-A14B", 57e9),
    "moe-e64": ("MoE-E64", 7.8e9),
    "moe-e128": ("MoE-E128", 7.6e9),
    "moe-e384": ("MoE-E384", 7.5e9),
    "moe-k4": ("MoE-K4", 7.5e9),
    "moe-k8": ("MoE-K8", 7.6e9),
    "moe-k12": ("MoE-K12", 7.6e9),
    "moe-k16": ("MoE-K16", 7.6e9),
    "moe-h512": ("MoE-H512", 7.72e9),
    "moe-h768": ("MoE-H768", 7.6e9),
    "moe-h2048": ("MoE-H2048", 8.2e9),
}


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the architecture formula, by component, with the totals.

    With d = head size, nq = num_attention_heads·d, nkv = num_key_value_heads·d, V = vocab,
    H = hidden, F = moe_intermediate, Fs = shared_expert_intermediate, I = intermediate:

    - `embedding`: V·H; `lm_head`: V·H, or 0 when `tie_word_embeddings`;
    - `attention` (every layer): q H·nq, k and v H·nkv each, o nq·H; biases: q/k/v (nq + 2·nkv)
      for qwen2_moe when `qkv_bias`, q/k/v/o (nq + 2·nkv + H) for qwen3_moe when
      `attention_bias`; qwen3_moe also has the q and k RMSNorm weights (2·d);
    - `norms`: 2 RMSNorms of H per layer plus the final norm H;
    - `router` (MoE layers): E·H, plus its logits' bias E with `router_bias`;
    - `experts` (MoE layers): E·3·H·F (gate/up/down), plus their biases E·(2·F + H) with
      `expert_biases`;
    - `shared_expert` (MoE layers, qwen2_moe with Fs > 0): 3·H·Fs plus its sigmoid gate H·1
      (without the gate when `shared_expert_gated` is false);
    - `dense_mlp` (the non-MoE layers, `ModelConfig.is_moe_layer`): 3·H·I.

    `total` is the sum: the number of elements in a Hugging Face `Qwen3MoeForCausalLM` /
    `Qwen2MoeForCausalLM` state dict of the same config (no buffers: RoPE frequencies and the
    aux-loss-free `expert_bias`, which is not trained by the optimizer, are not counted).
    `active` is what one token uses: `total` minus the (E - k) unchosen experts of each MoE layer
    (so it includes the embedding row, the LM head, attention, norms, router and shared expert).
    `active_experts` is the k chosen experts' part and `non_embedding` is `total` minus
    `embedding` and `lm_head`.
    """
    H, V, d = cfg.hidden_size, cfg.vocab_size, cfg.head_size
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    L = cfg.num_hidden_layers
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    n_dense = L - n_moe
    moe = cfg.moe
    E, k, F = moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size
    Fs = moe.shared_expert_intermediate_size
    per_expert = 3 * H * F + (2 * F + H if moe.expert_biases else 0)

    attn = H * nq + 2 * H * nkv + nq * H
    if cfg.arch == "qwen2_moe":
        attn += (nq + 2 * nkv) if cfg.qkv_bias else 0
    else:
        attn += 2 * d
        if cfg.attention_bias:
            attn += nq + 2 * nkv + H
    counts = {
        "embedding": V * H,
        "lm_head": 0 if cfg.tie_word_embeddings else V * H,
        "attention": L * attn,
        "norms": L * 2 * H + H,
        "router": n_moe * E * (H + (1 if moe.router_bias else 0)),
        "experts": n_moe * E * per_expert,
        "shared_expert": n_moe * (3 * H * Fs + (H if moe.shared_expert_gated else 0)) if Fs else 0,
        "dense_mlp": n_dense * 3 * H * cfg.intermediate_size,
    }
    total = sum(counts.values())
    active_experts = n_moe * k * per_expert
    counts.update(
        total=total,
        active=total - counts["experts"] + active_experts,
        active_experts=active_experts,
        non_embedding=total - counts["embedding"] - counts["lm_head"],
    )
    return counts


# ---------------------------------------------------------------------------------------------
# CLI


def _fmt(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if unit == "B" else f"{n / scale:.2f}{unit}"
    return str(int(n))


def _config_key(name) -> str:
    """`configs/qwen3.5-35b-a3b.yaml` or `qwen3.5-35b-a3b` -> `qwen3.5-35b-a3b`."""
    base = Path(name).name
    for suffix in (".yaml", ".yml"):
        base = base.removesuffix(suffix)
    return base


def table(names=None, **overrides) -> str:
    """The markdown table the CLI prints: the named configs, or every config in `configs/` (Table
    3's rows first, in the paper's order)."""
    if not names:
        have = available_configs()
        names = [n for n in PAPER_PARAMS if n in have] + [n for n in have if n not in PAPER_PARAMS]
    head = [
        "config",
        "arch",
        "L",
        "H",
        "F",
        "E",
        "k",
        "total",
        "active",
        "non-emb",
        "paper (Table 3)",
        "total/paper",
    ]
    rows = [head, ["---"] * len(head)]
    for name in names:
        cfg = load_config(name, **overrides)
        c = param_count(cfg)
        key = _config_key(name)
        paper = PAPER_PARAMS.get(key)
        rows.append(
            [
                key,
                cfg.arch,
                str(cfg.num_hidden_layers),
                str(cfg.hidden_size),
                str(cfg.moe.moe_intermediate_size),
                str(cfg.moe.num_experts),
                str(cfg.moe.num_experts_per_tok),
                _fmt(c["total"]),
                _fmt(c["active"]),
                _fmt(c["non_embedding"]),
                f"{paper[0]} {paper[1] / 1e9:g}B" if paper else "",
                f"{c['total'] / paper[1]:.3f}" if paper else "",
            ]
        )
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m relaymoe_jax.models.param_count",
        description="Parameter counts of the model configs (markdown table).",
    )
    ap.add_argument(
        "names",
        nargs="*",
        help="config names in configs/ or YAML paths (default: every config in configs/)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field in every config (repeatable)",
    )
    args = ap.parse_args(argv)
    try:
        print(table(args.names, **parse_overrides(args.overrides)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
