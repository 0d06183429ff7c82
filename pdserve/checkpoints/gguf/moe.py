"""`qwen2moe` and `qwen3moe` GGUF files read as transformers' GGUF loader reads them
(arch.ARCHES entries), into the checkpoint layout transformers saves; `olmoe` and Mixtral
(a `llama` file with `expert_count`, arch.LLAMA_EXPERTS), which transformers' loader does
not read, into theirs (Mixtral: block_sparse_moe.gate, experts.{j}.w1 / w3 / w2; OLMoE's
experts, experts {j}'s width feed_forward_length and its top-k weights not renormalised,
as llama.cpp computes both).

    ffn_{gate,up,down}_exps   [E, rows, cols], every expert's projection in one tensor:
                              written as E tensors mlp.experts.{j}.*_proj.weight
    ffn_gate_inp              the router, mlp.gate.weight [E, hidden]
    ffn_*_shexp               Qwen2-MoE's shared expert; ffn_gate_inp_shexp [hidden] is
                              its gate, [1, hidden] in the checkpoint

Config (integrations/ggml.py): expert_count -> num_experts, expert_used_count ->
num_experts_per_tok; qwen3moe's top-k weights are renormalised (transformers sets
norm_topk_prob for it, as llama.cpp computes). transformers' map reads no expert width,
so its loader can only load a file whose experts have the config class's default width
(Qwen3-MoE 768, Qwen2-MoE 1408, shared 5632); the width here is the file's own
`expert_feed_forward_length` / `expert_shared_feed_forward_length` (what llama.cpp
computes), the class default where the key is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.checkpoints.gguf.error import GGUFError

IMPLEMENTED_KEYS = frozenset({"expert_count"})
EXPERT_TENSORS = {
    "ffn_gate_exps.weight": "mlp.experts.{j}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{j}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{j}.down_proj.weight",
}
QWEN3MOE_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
QWEN2MOE_TENSORS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# OLMoE: q/k RMSNorm over the whole projection (attn_q_norm [q size]); rows unpermuted
OLMOE_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# Mixtral: a `llama` file with `expert_count`, the Mixtral checkpoint's names (w1 gate,
# w3 up, w2 down), experts intermediate_size (feed_forward_length) wide
MIXTRAL_TENSORS = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
MIXTRAL_EXPERT_TENSORS = {
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{j}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{j}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{j}.w2.weight",
}
# tensors stored with fewer dimensions than the checkpoint's: name suffix -> leading 1s
ROW_VECTORS = ("mlp.shared_expert_gate.weight",)
_WIDTHS = {
    "qwen2moe": {"expert_feed_forward_length": ("moe_intermediate_size", 1408),
                 "expert_shared_feed_forward_length": ("shared_expert_intermediate_size", 5632)},
    "qwen3moe": {"expert_feed_forward_length": ("moe_intermediate_size", 768)},
}  # fmt: skip


def config_fix(meta: Mapping[str, Any], name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    experts = "num_local_experts" if name == "llama" else "num_experts"
    for key, field in (
        ("expert_count", experts),
        ("expert_used_count", "num_experts_per_tok"),
    ):
        if meta.get(f"{name}.{key}") is None:
            raise GGUFError(f"key {name}.{key} is missing")
        out[field] = int(meta[f"{name}.{key}"])
    for key, (field, default) in _WIDTHS.get(name, {}).items():
        out[field] = int(meta.get(f"{name}.{key}") or default)
    if name == "qwen3moe":
        out["norm_topk_prob"] = True
    return out
