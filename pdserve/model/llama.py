"""Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Weights are plain tensors (no nn.Module): q/k/v and gate/up are fused at load
time so each layer runs four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionBackend
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.hf_config import ModelArch
from pdserve.model.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in float32 and cast back, as the reference implementation does
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor], max_positions: int) -> None:
        self.arch = arch
        dtype, device = (
            state["model.embed_tokens.weight"].dtype,
            state["model.embed_tokens.weight"].device,
        )
        self.embed = state["model.embed_tokens.weight"]
        self.norm = state["model.norm.weight"]
        self.lm_head = self.embed if arch.tie_word_embeddings else state["lm_head.weight"]
        self.layers = [self._layer(state, i) for i in range(arch.num_layers)]
        self.rope = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, dtype, str(device)
        )

    def _layer(self, s: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if self.arch.qkv_bias:
            bias = torch.cat([s[a + "q_proj.bias"], s[a + "k_proj.bias"], s[a + "v_proj.bias"]])
        return LayerWeights(
            input_norm=s[p + "input_layernorm.weight"],
            qkv=torch.cat([s[a + "q_proj.weight"], s[a + "k_proj.weight"], s[a + "v_proj.weight"]]),
            qkv_bias=bias,
            q_norm=s.get(a + "q_norm.weight") if self.arch.qk_norm else None,
            k_norm=s.get(a + "k_norm.weight") if self.arch.qk_norm else None,
            o=s[a + "o_proj.weight"],
            post_norm=s[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]]),
            down=s[p + "mlp.down_proj.weight"],
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Runs all T tokens; returns logits [B, vocab] at each request's last token."""
        attn.prepare(batch)
        h = F.embedding(batch.input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(
                i, layer, rms_norm(h, layer.input_norm, self.arch.rms_norm_eps), batch, attn
            )
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, self.arch.rms_norm_eps))
        last = h[batch.last_token_index()]
        return F.linear(rms_norm(last, self.norm, self.arch.rms_norm_eps), self.lm_head).float()

    def _attention(
        self, i: int, w: LayerWeights, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        a = self.arch
        t = x.shape[0]
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        q = qkv[:, : a.q_size].view(t, a.num_heads, a.head_dim)
        k = qkv[:, a.q_size : a.q_size + a.kv_size].view(t, a.num_kv_heads, a.head_dim)
        v = qkv[:, a.q_size + a.kv_size :].view(t, a.num_kv_heads, a.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q = rms_norm(q, w.q_norm, a.rms_norm_eps)
            k = rms_norm(k, w.k_norm, a.rms_norm_eps)
        q, k = self.rope.apply(q, k, batch.positions)
        out = attn.forward(i, q, k.contiguous(), v.contiguous(), batch)
        return F.linear(out, w.o)

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w.down)


# Hugging Face architecture name -> model class (all share the Llama layout)
MODEL_REGISTRY: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
}
