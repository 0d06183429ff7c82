"""What differs per GGUF architecture, as one table entry each (`ARCHES`).

An entry says which Hugging Face class the file becomes, which tensor names it may
hold beyond the dense-decoder skeleton, whether llama.cpp permuted its Q/K rows, how a
stored value differs from the Hugging Face one, which metadata keys would change the
computation (refused by name), and which config fields it adds. convert.py does
the rest the same way for every entry. To serve a new architecture exactly, add an
entry here; everything not described is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.checkpoints.gguf import gemma3 as gemma3_gguf
from pdserve.checkpoints.gguf import moe as moe_gguf

if TYPE_CHECKING:
    import numpy as np

# GGUF tensor name -> Hugging Face name, outside the blocks.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Inside block N (`blk.N.<key>` -> `model.layers.N.<value>`), every dense decoder.
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Metadata that would change the computation and that no entry implements unless it says
# so (`GGUFArch.implemented_keys`). Key suffix (after "<arch>.") -> what it is.
REFUSED_KEYS = {
    "rope.scaling.type": "rope scaling",
    "rope.scaling.factor": "rope scaling",
    "attention.sliding_window": "sliding window attention",
    "expert_count": "mixture of experts",
    "attention.clamp_kqv": "QKV clamping",
    "logit_scale": "logit scaling",
    "attention.value_length": "a value head size other than the key head size",
    "final_logit_softcapping": "final logit soft-capping",
    "attn_logit_softcapping": "attention logit soft-capping",
}

# (GGUF tensor name, de-quantized float32 rows) -> the Hugging Face values of those rows;
# called once per slab of rows, so it must act on each element (or row) alone
ValueFix = Callable[[str, "np.ndarray"], "np.ndarray"]
# (metadata, arch name, config so far) -> config fields to add or replace
ConfigFix = Callable[[Mapping[str, Any], str, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str  # config.json "architectures"
    model_type: str  # config.json "model_type"
    block_tensors: Mapping[str, str] = field(default_factory=dict)  # beyond BLOCK_TENSORS
    # llama.cpp interleaves each head's Q/K rows for Llama (and only Llama-arch files:
    # Mistral, TinyLlama, ...); transformers undoes it by the same rule.
    permute_qk: bool = False
    value_fix: ValueFix | None = None
    config_fix: ConfigFix | None = None
    implemented_keys: frozenset[str] = frozenset()  # REFUSED_KEYS this entry handles
    hidden_act: str = "silu"
    # a block's [E, rows, cols] tensor of every expert -> the Hugging Face name of expert
    # {j}'s [rows, cols] (checkpoints hold one tensor per expert, as transformers saves)
    expert_tensors: Mapping[str, str] = field(default_factory=dict)

    def tensor_table(self) -> dict[str, str]:
        return {**BLOCK_TENSORS, **self.block_tensors, **self.expert_tensors}


ARCHES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": GGUFArch(
        "Qwen2ForCausalLM",
        "qwen2",
        block_tensors={
            "attn_q.bias": "self_attn.q_proj.bias",
            "attn_k.bias": "self_attn.k_proj.bias",
            "attn_v.bias": "self_attn.v_proj.bias",
        },
    ),
    "qwen3": GGUFArch(
        "Qwen3ForCausalLM",
        "qwen3",
        block_tensors={
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
        },
    ),
    "gemma3": GGUFArch(
        gemma3_gguf.HF_ARCHITECTURE,
        gemma3_gguf.MODEL_TYPE,
        block_tensors=gemma3_gguf.BLOCK_TENSORS,
        value_fix=gemma3_gguf.value_fix,
        config_fix=gemma3_gguf.config_fix,
        implemented_keys=gemma3_gguf.IMPLEMENTED_KEYS,
        hidden_act="gelu_pytorch_tanh",  # not read by Gemma 3 (hidden_activation is)
    ),
    # Phi-3 / Phi-4-mini: q|k|v and gate|up stored fused, as the Hugging Face checkpoint
    # holds them (partial rotary and longrope's factor tensors are refused by name)
    "phi3": GGUFArch(
        "Phi3ForCausalLM",
        "phi3",
        block_tensors={
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
        },
    ),
    "qwen2moe": GGUFArch(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        block_tensors=moe_gguf.QWEN2MOE_TENSORS,
        config_fix=moe_gguf.config_fix,
        implemented_keys=moe_gguf.IMPLEMENTED_KEYS,
        expert_tensors=moe_gguf.EXPERT_TENSORS,
    ),
    "qwen3moe": GGUFArch(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        block_tensors=moe_gguf.QWEN3MOE_TENSORS,
        config_fix=moe_gguf.config_fix,
        implemented_keys=moe_gguf.IMPLEMENTED_KEYS,
        expert_tensors=moe_gguf.EXPERT_TENSORS,
    ),
    "olmoe": GGUFArch(
        "OlmoeForCausalLM",
        "olmoe",
        block_tensors=moe_gguf.OLMOE_TENSORS,
        config_fix=moe_gguf.config_fix,
        implemented_keys=moe_gguf.IMPLEMENTED_KEYS,
        expert_tensors=moe_gguf.EXPERT_TENSORS,
    ),
}

# A `llama` file with experts (`llama.expert_count`: Mixtral, as llama.cpp's converter
# writes it): Q/K rows permuted as any llama file's.
LLAMA_EXPERTS = GGUFArch(
    "MixtralForCausalLM",
    "mixtral",
    block_tensors=moe_gguf.MIXTRAL_TENSORS,
    permute_qk=True,
    config_fix=moe_gguf.config_fix,
    implemented_keys=moe_gguf.IMPLEMENTED_KEYS,
    expert_tensors=moe_gguf.MIXTRAL_EXPERT_TENSORS,
)


def arch_entry(name: str, experts: bool) -> GGUFArch:
    """The entry for architecture `name` (KeyError: none); `experts`: the file holds a
    mixture of experts (a `llama` one is Mixtral)."""
    return LLAMA_EXPERTS if name == "llama" and experts else ARCHES[name]
