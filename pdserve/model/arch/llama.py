"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Weights are plain tensors (no nn.Module): q/k/v and gate/up are fused at load
time so each layer runs four matmuls, each a `Linear` whose weight is stored in the
layout the device's fast GEMM reads (pdserve.model.layers.linear). The passes between them
(norms, rotation, activation, residual adds) go through `self.ops` (pdserve.model.layers.ops).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.arch import llama_config, rules
from pdserve.model.arch.config import Architecture, ModelArch
from pdserve.model.attention.backends import AttentionBackend
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.activations import ACTIVATIONS
from pdserve.model.layers.linear import Linear
from pdserve.model.layers.ops import TorchOps
from pdserve.model.layers.rope import RotaryEmbedding
from pdserve.model.state_reader import CheckpointMismatch, StateReader


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v fused (bias too, where the architecture has one)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate, up fused
    down: Linear


class LlamaModel:
    # the embedding as quantized row look-ups (model/quant_weights.py); None: self.embed
    embed_quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor], max_positions: int) -> None:
        """`state`: Hugging Face tensor names -> tensors. Raises CheckpointMismatch when a
        tensor the config implies is missing or a tensor is left unused. What an
        architecture's checkpoint and layer differ in, a subclass says through the hooks
        below (`tensor_shapes`, `_layer`, `_norm_weight`)."""
        self.arch = arch
        w = StateReader(state, self.tensor_shapes(arch))
        self.embed = w.take("model.embed_tokens.weight")
        dtype, device = self.embed.dtype, self.embed.device
        self.layers = [self._layer(w, i) for i in range(arch.num_layers)]
        self.norm = self._norm_weight(w.take("model.norm.weight"))
        self.lm_head = Linear(self._lm_head(w))
        w.check_all_used()
        self.act = ACTIVATIONS[arch.hidden_act]
        self.ops = TorchOps()  # NativeOps once a CPU engine turns them on
        # one rope per distinct (theta, scaling) of the layers (ModelArch.layer_rope): one
        # for the Llama family, Gemma 3's sliding and full layers' two
        kinds = [repr(arch.layer_rope(i)) for i in range(arch.num_layers)]
        distinct = list(dict.fromkeys(kinds))
        self.ropes = [_rope(arch, kinds.index(k), max_positions, dtype, str(device))
                      for k in distinct]  # fmt: skip
        self.rope_of_layer = [distinct.index(k) for k in kinds]
        self.rope = self.ropes[0]  # the Llama layer's; its cos table bounds positions (runner)

    # -- per-architecture hooks --------------------------------------------------------

    @staticmethod
    def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
        """Every tensor name the config implies -> its shape (lm_head only when untied)."""
        return tensor_shapes(a)

    def _layer(self, w: StateReader, i: int) -> LayerWeights:
        """Layer `i`'s weights, taken from `w`."""
        a, p = self.arch, f"model.layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."

        def cat(names: list[str], on: bool = True) -> torch.Tensor | None:
            return torch.cat([w.take(n) for n in names]) if on else None

        qkv = [att + f"{x}_proj." for x in "qkv"]
        gate_up = [mlp + "gate_proj.", mlp + "up_proj."]
        return LayerWeights(
            input_norm=w.take(p + "input_layernorm.weight"),
            qkv=Linear(
                _must(cat([n + "weight" for n in qkv])), cat([n + "bias" for n in qkv], a.qkv_bias)
            ),
            q_norm=w.take(att + "q_norm.weight") if a.qk_norm else None,
            k_norm=w.take(att + "k_norm.weight") if a.qk_norm else None,
            o=Linear(
                w.take(att + "o_proj.weight"), w.take(att + "o_proj.bias") if a.o_bias else None
            ),
            post_norm=w.take(p + "post_attention_layernorm.weight"),
            gate_up=Linear(
                _must(cat([n + "weight" for n in gate_up])),
                cat([n + "bias" for n in gate_up], a.mlp_bias),
            ),
            down=Linear(
                w.take(mlp + "down_proj.weight"),
                w.take(mlp + "down_proj.bias") if a.mlp_bias else None,
            ),
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's weight as the forward multiplies by it."""
        return weight

    def quant_embed_ok(self) -> bool:
        """Whether the forward looks tokens up through embed_rows (a subclass's own
        forward may index self.embed instead, which a quantized embedding empties)."""
        return "embed_rows" in inspect.unwrap(type(self).forward).__code__.co_names

    def use_quant_embed(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look tokens up through `lookup`; the float embedding is dropped."""
        self.embed_quant = lookup
        self.embed = torch.empty(0, self.arch.hidden_size, dtype=self.embed.dtype)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        lookup = self.embed_quant
        return F.embedding(ids, self.embed) if lookup is None else lookup(ids)

    def linears(self) -> list[Linear]:
        """Every projection, in the order a forward applies them."""
        per_layer = [(x.qkv, x.o, x.gate_up, x.down) for x in self.layers]
        return [lin for group in per_layer for lin in group] + [self.lm_head]

    def _lm_head(self, w: StateReader) -> torch.Tensor:
        if not self.arch.tie_word_embeddings:
            return w.take("lm_head.weight", why="tie_word_embeddings is false")
        # transformers ties the head to the embedding and ignores a stored copy; one that
        # differs would be silently dropped, so it is refused
        head = w.take_optional("lm_head.weight")
        if head is not None and not torch.equal(head, self.embed):
            raise CheckpointMismatch(
                "lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings "
                "is true (transformers would ignore lm_head.weight)"
            )
        return self.embed

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        attn: AttentionBackend,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Runs all T tokens; returns logits [B, vocab] at each request's last token.
        Precondition: `batch` was prepared (ModelRunner.prepare); only device work here.
        `between_layers` runs before every layer but the first (the core share's thread
        count, read again). The one decoder loop of every architecture: a subclass
        changes its hooks (`_scale_embedding`, `_block`, `_norm`, `_logits`), not this."""
        h = self._scale_embedding(self.embed_rows(batch.input_ids))
        tables = [r.tables(batch.positions, batch) for r in self.ropes]  # shared by the layers
        delta = None  # the last sublayer's output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            if i and between_layers is not None:
                between_layers()
            h, delta = self._block(i, layer, h, delta, tables[self.rope_of_layer[i]], batch, attn)
        last = batch.last_index  # the final norm and the head only at each request's last token
        _, x = self._norm(h[last], None if delta is None else delta[last], self.norm)
        return self._logits(x)

    def _scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def _block(
        self,
        i: int,
        layer: LayerWeights,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i: (the residual stream, the output the next norm adds to it)."""
        h, x = self._norm(h, delta, layer.input_norm)
        delta = self._attention(i, layer, x, rope, batch, attn)
        h, x = self._norm(h, delta, layer.post_norm)
        return h, self._mlp(layer, x)

    def _norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta)); delta None: nothing added. The ops may add in
        place into `h` (NativeOps): only tensors this forward made are passed."""
        return self.ops.add_norm(h, delta, weight, self.arch.rms_norm_eps)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x).float()

    def _attention(
        self,
        i: int,
        w: LayerWeights,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        a, ops = self.arch, self.ops
        t, h = x.shape[0], a.num_heads
        qkv = w.qkv(x)
        v = qkv[:, a.q_size + a.kv_size :].view(t, a.num_kv_heads, a.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q = ops.head_norm(qkv[:, : a.q_size].view(t, h, a.head_dim), w.q_norm, a.rms_norm_eps)
            k = qkv[:, a.q_size : a.q_size + a.kv_size].view(t, a.num_kv_heads, a.head_dim)
            q = ops.rotate(q, rope)
            k = ops.rotate(ops.head_norm(k, w.k_norm, a.rms_norm_eps), rope)
        else:  # q and k sit side by side in qkv: one rotation for both
            qk = ops.rotate(qkv[:, : a.q_size + a.kv_size].view(t, h + a.num_kv_heads, -1), rope)
            q, k = qk[:, :h], qk[:, h:]
        return w.o(attn.forward(i, q, k, v, batch))  # k, v: views of rows (backends take them)

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return w.down(self.ops.act_mul(self.act, w.gate_up(x)))


def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (lm_head only when untied)."""
    h, inter, q, kv = a.hidden_size, a.intermediate_size, a.q_size, a.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (a.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (a.vocab_size, h),
    }
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if a.qkv_bias:
            layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,)})
            layer["self_attn.v_proj.bias"] = (kv,)
        if a.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if a.mlp_bias:
            layer.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,)})
            layer["mlp.down_proj.bias"] = (h,)
        if a.qk_norm:
            layer.update({"self_attn.q_norm.weight": (a.head_dim,)})
            layer["self_attn.k_norm.weight"] = (a.head_dim,)
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def _rope(
    arch: ModelArch, layer: int, max_positions: int, dtype: torch.dtype, device: str
) -> RotaryEmbedding:
    theta, scaling = arch.layer_rope(layer)
    return RotaryEmbedding(
        arch.head_dim, max_positions, theta, scaling, dtype, device, arch.rotary_dim
    )


def _must(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t


ARCHITECTURES = tuple(
    Architecture(name, model_types, llama_config.read_config, LlamaModel, gguf)
    for name, model_types, gguf in (
        (rules.LLAMA, ("llama",), "llama"),
        (rules.MISTRAL, ("mistral",), None),
        (rules.QWEN2, ("qwen2",), "qwen2"),
        (rules.QWEN3, ("qwen3",), "qwen3"),
    )
)  # Mistral, Qwen2 and Qwen3 share the Llama layout; their config rules differ
