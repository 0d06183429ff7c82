"""Gemma 3 decoder (`Gemma3ForCausalLM`), computed as transformers' modeling_gemma3 does.

What differs from the Llama layer (pdserve.model.arch.llama), per layer:

    x = norm_in(h);   a = o(attn(rope_l(q_norm(q)), rope_l(k_norm(k)), v))
    h = h + norm_post_attn(a)
    x = norm_pre_ff(h);   h = h + norm_post_ff(down(gelu_tanh(gate(x)) * up(x)))

- every RMSNorm scales by (1 + weight), computed in float32 and then cast (Llama casts
  before scaling): the (1 + weight) vectors are made once at load, in float32;
- the embedding output is multiplied by sqrt(hidden_size) rounded to the model's dtype;
- rope_l is the rope of the layer's type (sliding or full attention, ModelArch.layer_rope);
- the attention scale is query_pre_attn_scalar ** -0.5 (ModelArch.attention_scale; the
  runner hands it to the attention backend), the window is the layer's;
- the logits may be soft-capped: cap * tanh(logits / cap).

For fp32 weights the norms go through `self.ops` (TorchOps or the native NativeOps) with
the (1 + weight) vector as their weight: `w1 * normed` is transformers' `normed * w1`
bit for bit. Other dtypes take `gemma_rms_norm`, transformers' order of operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.arch import gemma3_config
from pdserve.model.arch.config import Architecture, ModelArch
from pdserve.model.arch.llama import LayerWeights, LlamaModel
from pdserve.model.attention.backends import AttentionBackend
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.linear import Linear
from pdserve.model.state_reader import StateReader

Tables = tuple[torch.Tensor, torch.Tensor]


def gemma_rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm with w1 = 1 + weight (float32): scaled in float32, then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w1).to(x.dtype)


@dataclass
class Gemma3Layer(LayerWeights):
    # the inherited norms hold 1 + weight (float32): input_norm is input_layernorm,
    # post_norm is post_attention_layernorm (on the attention's output), q_norm and k_norm
    pre_ff_norm: torch.Tensor  # pre_feedforward_layernorm
    post_ff_norm: torch.Tensor  # post_feedforward_layernorm (on the MLP's output)


class Gemma3Model(LlamaModel):
    """The Llama model's interface (weights, `linears`, `forward`) with Gemma 3's layer:
    its own tensors, layer and norm weights (LlamaModel's hooks) and embedding scale."""

    layers: list[Gemma3Layer]  # type: ignore[assignment]

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor], max_positions: int) -> None:
        super().__init__(arch, state, max_positions)
        # transformers keeps sqrt(hidden) as a float32 scalar and casts it to the weights'
        # dtype (in bfloat16 sqrt(640) = 25.30 becomes 25.25)
        scale = torch.tensor(arch.hidden_size**0.5)
        self.embed_scale = scale.to(dtype=self.embed.dtype, device=self.embed.device)

    @staticmethod
    def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(a)

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return _plus_one(weight)

    def _layer(self, w: StateReader, i: int) -> Gemma3Layer:
        a, p = self.arch, f"model.layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."

        def linear(names: list[str]) -> Linear:
            weight = torch.cat([w.take(n + "weight") for n in names])
            bias = torch.cat([w.take(n + "bias") for n in names]) if a.qkv_bias else None
            return Linear(weight, bias)

        return Gemma3Layer(
            input_norm=_plus_one(w.take(p + "input_layernorm.weight")),
            qkv=linear([att + f"{x}_proj." for x in "qkv"]),
            q_norm=_plus_one(w.take(att + "q_norm.weight")),
            k_norm=_plus_one(w.take(att + "k_norm.weight")),
            o=linear([att + "o_proj."]),
            post_norm=_plus_one(w.take(p + "post_attention_layernorm.weight")),
            gate_up=Linear(torch.cat([w.take(mlp + f"{x}_proj.weight") for x in ("gate", "up")])),
            down=Linear(w.take(mlp + "down_proj.weight")),
            pre_ff_norm=_plus_one(w.take(p + "pre_feedforward_layernorm.weight")),
            post_ff_norm=_plus_one(w.take(p + "post_feedforward_layernorm.weight")),
        )

    def _norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, gemma_rms_norm(h + delta)), `weight` already 1 + w; delta None:
        nothing added. The ops may add in place into `h` (NativeOps)."""
        eps = self.arch.rms_norm_eps
        if h.dtype == torch.float32:
            return self.ops.add_norm(h, delta, weight, eps)
        if delta is not None:
            h = h + delta
        return h, gemma_rms_norm(h, weight, eps)

    def _head_norm(self, x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        eps = self.arch.rms_norm_eps
        if x.dtype == torch.float32:
            return self.ops.head_norm(x, w1, eps)
        return gemma_rms_norm(x, w1, eps)

    def _scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.embed_scale

    def _block(
        self,
        i: int,
        layer: LayerWeights,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        rope: Tables,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich norms: each sublayer's output is normed before it joins the stream."""
        assert isinstance(layer, Gemma3Layer)
        h, x = self._norm(h, delta, layer.input_norm)
        _, a = self._norm(
            self._gemma_attention(i, layer, x, rope, batch, attn), None, layer.post_norm
        )
        h, x = self._norm(h, a, layer.pre_ff_norm)
        _, out = self._norm(self._mlp(layer, x), None, layer.post_ff_norm)
        return h, out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        cap = self.arch.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _gemma_attention(
        self,
        i: int,
        w: Gemma3Layer,
        x: torch.Tensor,
        rope: Tables,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        a, ops = self.arch, self.ops
        t, d = x.shape[0], a.head_dim
        qkv = w.qkv(x)
        q = qkv[:, : a.q_size].view(t, a.num_heads, d)
        k = qkv[:, a.q_size : a.q_size + a.kv_size].view(t, a.num_kv_heads, d)
        v = qkv[:, a.q_size + a.kv_size :].view(t, a.num_kv_heads, d)
        assert w.q_norm is not None and w.k_norm is not None
        q = ops.rotate(self._head_norm(q, w.q_norm), rope)
        k = ops.rotate(self._head_norm(k, w.k_norm), rope)
        return w.o(attn.forward(i, q, k, v, batch))


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    """1 + weight in float32, as Gemma3RMSNorm computes it on every call."""
    return 1.0 + weight.float()


def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (lm_head only when untied)."""
    h, inter, q, kv, d = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size, a.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (a.vocab_size, h),
    }
    for i in range(a.num_layers):
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "pre_feedforward_layernorm.weight": (h,),
            "post_feedforward_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if a.qkv_bias:
            layer.update({f"self_attn.{x}_proj.bias": (n,) for x, n in zip("qkvo", (q, kv, kv, h))})
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


ARCHITECTURE = Architecture(
    gemma3_config.GEMMA3, ("gemma3_text",), gemma3_config.read_config, Gemma3Model, "gemma3"
)
