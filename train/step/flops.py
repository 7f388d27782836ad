"""Model FLOPs of a train step, and the MFU the metrics line reports.

    model FLOPs = 6 x active parameters x tokens + 12 x layers x heads x head_dim x visible pairs

- **active parameters**: the parameters a token multiplies, from the model's own parameter tree
  (`active_params`): everything but the embedding table (a lookup; with tied embeddings it is the
  LM head and counts), the routed experts' weights (and biases) counted k / E (a token meets k of
  E experts); the router, attention, norms, shared experts and the LM head in full. 6 = 2 FLOPs
  per multiply-add x (forward + the two backward products), the usual convention (PaLM's
  appendix B, Megatron's MFU).
- **attention**: per layer and head, QK^T and PV cost 2 x head_dim FLOPs each per (query, key)
  pair, 3x for forward + backward: 12 x head_dim; `visible_pairs` counts the causal pairs within
  each document of a packed row (sum of n (n + 1) / 2 over its documents; a row without
  boundaries is one document of seq_len).
- Not counted, by convention: recomputation (remat, the ring's per-hop recompute), the router's
  softmax and top-k, norms' and activations' elementwise work, the optimizer. So the compiled
  step's own count is higher (tests/test_flops.py measures the gap on XLA:CPU).

MFU = model FLOPs / step time / devices / the device's dense bf16 peak (`PEAK_BF16_TFLOPS`, by
`device_kind`); None where the device is not in the table (CPU), the TFLOP/s per device are
logged either way.
"""

import dataclasses

import jax
import numpy as np

EXPERT_LEAVES = frozenset({"w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"})

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOP/s per GPU, from NVIDIA's datasheets;
# matched in order against `device_kind` (a PCIe H100 before the SXM one).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM (the cost model's H100_BF16_TFLOPS)
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("A100", 312.0),
    ("B200", 2250.0),
)


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of a device kind, or None (CPU, a GPU not in the table)."""
    for name, peak in PEAK_BF16_TFLOPS:
        if name.lower() in device_kind.lower():
            return peak
    return None


def active_params(
    params, top_k: int, num_experts: int, tied_embeddings: bool, within: str | None = None
) -> int:
    """The parameters one token multiplies (module doc), from the model's parameter tree; those
    under a module named `within` only (e.g. "mlp": the MLP and MoE blocks) if given."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        n = float(np.prod(np.shape(leaf)))
        if names and names[0] == "embed_tokens" and not tied_embeddings:
            continue
        if within is not None and within not in names:
            continue
        if "mlp" in names and names[-1] in EXPERT_LEAVES and num_experts:
            n *= top_k / num_experts
        total += n
    return round(total)


def expert_active_params(params, top_k: int, num_experts: int) -> int:
    """The routed experts' parameters one token multiplies: their weights (and biases) x k / E."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if "mlp" in names and names[-1] in EXPERT_LEAVES and num_experts:
            total += float(np.prod(np.shape(leaf))) * top_k / num_experts
    return round(total)


def visible_pairs(tokens, segment_ids=None) -> int:
    """Causal (query, key) pairs within documents of the rows [rows, seq]: n (n + 1) / 2 per
    document piece (`segment_ids` > 0; 0 is padding), seq (seq + 1) / 2 per row without ids."""
    rows, seq = np.shape(tokens)
    if segment_ids is None:
        return rows * seq * (seq + 1) // 2
    seg = np.asarray(segment_ids)
    total = 0
    for r in seg:
        _, counts = np.unique(r[r > 0], return_counts=True)
        total += int(np.sum(counts * (counts + 1) // 2))
    return total


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """A model's FLOP counts: 6 x active parameters per token, 12 x layers x heads x head_dim
    per visible pair."""

    per_token: float
    per_pair: float
    peak_tflops: float | None  # the device's dense bf16 peak (None: not known)

    @classmethod
    def of(cls, cfg, params, device_kind: str) -> "StepFlops":
        moe = cfg.moe
        active = active_params(
            params, moe.num_experts_per_tok, moe.num_experts, cfg.tie_word_embeddings
        )
        per_pair = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_size
        return cls(6.0 * active, per_pair, peak_tflops(device_kind))

    def step(self, tokens: int, pairs: int) -> float:
        """Model FLOPs of a step of `tokens` tokens and `pairs` visible (query, key) pairs."""
        return self.per_token * tokens + self.per_pair * pairs

    def record(self, tokens: int, pairs: int, seconds: float, devices: int) -> dict:
        """`model_tflops_per_device` and `mfu` (None without a known peak) of one step."""
        tflops = self.step(tokens, pairs) / seconds / devices / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"model_tflops_per_device": tflops, "mfu": mfu}
