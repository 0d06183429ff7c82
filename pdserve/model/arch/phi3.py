"""Phi-3 decoder (`Phi3ForCausalLM`): the Llama layer read from Phi-3's fused checkpoint.

The checkpoint stores q|k|v as one `self_attn.qkv_proj` and gate|up as one
`mlp.gate_up_proj`, in the order LlamaModel fuses them at load, so the tensors are taken
as they are. What else differs is in the config (arch/phi3_config.py): longrope, partial
rotary (the rope tables are rotary_dim wide; layers/rope.py turns that part of each head).
"""

from __future__ import annotations

from pdserve.model.arch import phi3_config
from pdserve.model.arch.config import Architecture, ModelArch
from pdserve.model.arch.llama import LayerWeights, LlamaModel
from pdserve.model.layers.linear import Linear
from pdserve.model.state_reader import StateReader


class Phi3Model(LlamaModel):
    same_compute_as_llama = True  # the native one-call decode computes it (native_forward.py)

    @staticmethod
    def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(a)

    def _layer(self, w: StateReader, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight"),
            qkv=Linear(w.take(p + "self_attn.qkv_proj.weight")),
            q_norm=None,
            k_norm=None,
            o=Linear(w.take(p + "self_attn.o_proj.weight")),
            post_norm=w.take(p + "post_attention_layernorm.weight"),
            gate_up=Linear(w.take(p + "mlp.gate_up_proj.weight")),
            down=Linear(w.take(p + "mlp.down_proj.weight")),
        )


def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (lm_head only when untied)."""
    h, inter, q, kv = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (a.vocab_size, h),
    }
    for i in range(a.num_layers):
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.qkv_proj.weight": (q + 2 * kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_up_proj.weight": (2 * inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


ARCHITECTURE = Architecture(phi3_config.PHI3, ("phi3",), phi3_config.read_config, Phi3Model, "phi3")
