"""Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE), computed as
transformers' modeling files do; the config side is arch/moe_config.py.

The attention is the Llama layer's (OLMoE: q/k RMSNorm over the whole projection, then
`clip_qkv`). A sparse layer's MLP, per token x:

    p = softmax(router(x)) in float32;  (w, e) = top_k(p);  w /= sum(w) where norm_topk_prob
    y = sum_j w_j * down_e_j(act(gate_e_j(x)) * up_e_j(x))
        + sigmoid(shared_gate(x)) * shared(x)            (Qwen2-MoE's shared expert)

Each projection of the experts is one tensor, [E, 2I, H] (gate | up) and [E, H, I]
(down). A step groups its tokens by expert and runs each routed expert once over its
tokens, so it reads only the experts its batch routes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.arch import moe_config
from pdserve.model.arch.config import Architecture, ModelArch, MoeSpec
from pdserve.model.arch.llama import LayerWeights, LlamaModel
from pdserve.model.arch.llama import tensor_shapes as dense_shapes
from pdserve.model.arch.moe_config import MIXTRAL, OLMOE
from pdserve.model.attention.backends import AttentionBackend
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.linear import Linear
from pdserve.model.layers.ops import TorchOps, rms_norm
from pdserve.model.layers.quant_experts import ExpertNames, QuantExperts
from pdserve.model.state_reader import StateReader


@dataclass
class Experts:
    """One sparse MLP: the router and every expert's weights as one tensor each."""

    router: Linear  # [E, H]: one logit per expert
    gate_up: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]
    shared_gate_up: Linear | None  # Qwen2-MoE's shared expert, and its [1, H] gate
    shared_down: Linear | None
    shared_gate: Linear | None
    # the experts in a GGUF's blocks (model/quant_experts.py; gate_up and down then unread)
    quant: QuantExperts | None = None

    def held(self) -> list[torch.Tensor]:
        """The tensors the experts' weights are held in (the Linears hold their own)."""
        return self.quant.held() if self.quant else [self.gate_up, self.down]


@dataclass
class MoeLayer(LayerWeights):
    experts: Experts | None  # None: a dense layer (gate_up and down, inherited, hold it)


class MoeModel(LlamaModel):
    layers: list[MoeLayer]  # type: ignore[assignment]

    @staticmethod
    def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(a)

    def _layer(self, w: StateReader, i: int) -> MoeLayer:
        if not spec_of(self.arch).sparse[i]:
            return MoeLayer(**vars(super()._layer(w, i)), experts=None)
        # the attention as the Llama layer reads it; the dense MLP it would take is absent
        layer = super()._layer(_NoDenseMlp(w, f"model.layers.{i}.mlp."), i)
        return MoeLayer(**vars(layer), experts=_experts(w, self.arch, i))

    def linears(self) -> list[Linear]:
        out: list[Linear] = []
        for x in self.layers:
            out += [x.qkv, x.o]
            e = x.experts
            if e is None:
                out += [x.gate_up, x.down]
                continue
            out.append(e.router)
            out += [lin for lin in (e.shared_gate_up, e.shared_down, e.shared_gate) if lin]
        return [*out, self.lm_head]

    def _attention(
        self,
        i: int,
        w: LayerWeights,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        a = self.arch
        if a.architecture != OLMOE:
            return super()._attention(i, w, x, rope, batch, attn)
        t, d, eps = x.shape[0], a.head_dim, a.rms_norm_eps
        qkv = w.qkv(x)
        assert w.q_norm is not None and w.k_norm is not None
        q = rms_norm(qkv[:, : a.q_size], w.q_norm, eps)  # over the whole projection
        k = rms_norm(qkv[:, a.q_size : a.q_size + a.kv_size], w.k_norm, eps)
        v = qkv[:, a.q_size + a.kv_size :]
        if a.clip_qkv is not None:
            q, k, v = (y.clamp(-a.clip_qkv, a.clip_qkv) for y in (q, k, v))
        q = self.ops.rotate(q.reshape(t, a.num_heads, d), rope)
        k = self.ops.rotate(k.reshape(t, a.num_kv_heads, d), rope)
        return w.o(attn.forward(i, q, k, v.reshape(t, a.num_kv_heads, d), batch))

    def _mlp(self, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        e = w.experts if isinstance(w, MoeLayer) else None
        if e is None:
            return super()._mlp(w, x)
        out = self._routed(e, x)
        if e.shared_gate_up is not None and e.shared_down is not None and e.shared_gate:
            shared = e.shared_down(self.ops.act_mul(self.act, e.shared_gate_up(x)))
            out = self.ops.moe_gated_add(out, e.shared_gate(x), shared)
        return out

    def _routed(self, e: Experts, x: torch.Tensor) -> torch.Tensor:
        """The top-k experts' outputs of each token, weighted and summed."""
        spec = spec_of(self.arch)
        weights, chosen = self.ops.moe_route(e.router(x), spec.top_k, spec.norm_topk_prob)
        flat_w, k = weights.to(x.dtype).flatten(), chosen.shape[1]
        # (token, slot) pairs sorted by expert: each expert's tokens are one run
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=spec.num_experts)
        tokens = order // k
        if e.quant is not None:  # every routed expert in two kernel calls
            y = e.quant(x[tokens], counts.tolist(), lambda h: self.ops.act_mul(self.act, h))
            # each token's k outputs added in expert order (the one-call decode forward,
            # kernels/native/decode_moe.h, groups and adds them alike)
            return self.ops.moe_combine(y, flat_w[order], tokens, x.shape[0])
        out, start = torch.zeros_like(x), 0
        for expert, n in enumerate(counts.tolist()):
            if n == 0:
                continue  # never read: its weights stay where they lie
            pairs = order[start : start + n]
            start += n
            h = self.ops.act_mul(self.act, x[pairs // k] @ e.gate_up[expert].t())
            y = (h @ e.down[expert].t()) * flat_w[pairs, None]
            out.index_add_(0, pairs // k, y)
        return out


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k]) of router logits [T, E] as torch computes
    them: softmax in float32, the top k, renormalised to sum 1 where the spec says."""
    return TorchOps().moe_route(logits, spec.top_k, spec.norm_topk_prob)


def spec_of(a: ModelArch) -> MoeSpec:
    """A mixture-of-experts model's MoeSpec."""
    assert a.moe is not None
    return a.moe


class _NoDenseMlp(StateReader):
    """`inner`, but a 1x1 zero stands in for each dense MLP tensor under `prefix` (a
    sparse layer has none; MoeLayer's `experts` replace them and they are never run)."""

    def __init__(self, inner: StateReader, prefix: str) -> None:
        self.inner, self.dense = inner, tuple(prefix + n for n in _DENSE)

    def take(self, name: str, why: str = "") -> torch.Tensor:
        return torch.zeros(1, 1) if name.startswith(self.dense) else self.inner.take(name, why)

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.inner.take_optional(name)


_DENSE = ("gate_proj.", "up_proj.", "down_proj.")


def _names(a: ModelArch, i: int) -> tuple[str, str, tuple[str, str, str]]:
    """(the MLP's prefix, the router's name, (gate, up, down) names of expert {j})."""
    if a.architecture == MIXTRAL:
        p = f"model.layers.{i}.block_sparse_moe."
        parts = ("w1", "w3", "w2")
    else:
        p, parts = f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")
    gate, up, down = (p + "experts.{j}." + n + ".weight" for n in parts)
    return p, p + "gate.weight", (gate, up, down)


def _experts(w: StateReader, a: ModelArch, i: int) -> Experts:
    spec = spec_of(a)
    p, router, (gate, up, down) = _names(a, i)
    experts = range(spec.num_experts)
    gate_up = torch.stack(
        [torch.cat([w.take(gate.format(j=j)), w.take(up.format(j=j))]) for j in experts]
    )  # fmt: skip
    downs = torch.stack([w.take(down.format(j=j)) for j in experts])
    shared: list[Linear | None] = [None, None, None]
    if spec.shared_size:
        s = p + "shared_expert."
        fused = torch.cat([w.take(s + "gate_proj.weight"), w.take(s + "up_proj.weight")])
        shared = [Linear(fused), Linear(w.take(s + "down_proj.weight"))]
        shared.append(Linear(w.take(p + "shared_expert_gate.weight")))
    return Experts(Linear(w.take(router)), gate_up, downs, shared[0], shared[1], shared[2])


def linear_groups(a: ModelArch) -> list[list[str]]:
    """The weight names of each Linear, in MoeModel.linears() order (less lm_head)."""
    spec, groups = spec_of(a), []
    for i in range(a.num_layers):
        att, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        groups += [[att + f"{x}_proj.weight" for x in "qkv"], [att + "o_proj.weight"]]
        if not spec.sparse[i]:
            groups += [
                [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                [mlp + "down_proj.weight"],
            ]
            continue
        p, router, _ = _names(a, i)
        groups.append([router])
        if spec.shared_size:
            s = p + "shared_expert."
            groups += [[s + "gate_proj.weight", s + "up_proj.weight"], [s + "down_proj.weight"]]
            groups.append([p + "shared_expert_gate.weight"])
    return groups


def expert_names(a: ModelArch) -> list[ExpertNames | None]:
    """Per layer: (gate, up, down) names of expert {j}, or None for a dense layer."""
    return [_names(a, i)[2] if spec_of(a).sparse[i] else None for i in range(a.num_layers)]


def tensor_shapes(a: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies -> its shape (lm_head only when untied)."""
    spec, h = spec_of(a), a.hidden_size
    shapes = dense_shapes(a)
    for i in range(a.num_layers):
        if a.architecture == OLMOE:  # q/k norms over the whole projection
            shapes[f"model.layers.{i}.self_attn.q_norm.weight"] = (a.q_size,)
            shapes[f"model.layers.{i}.self_attn.k_norm.weight"] = (a.kv_size,)
        if not spec.sparse[i]:
            continue
        for dense in _DENSE:
            del shapes[f"model.layers.{i}.mlp.{dense}weight"]
        p, router, (gate, up, down) = _names(a, i)
        shapes[router] = (spec.num_experts, h)
        inter = spec.expert_size
        for j in range(spec.num_experts):
            shapes[gate.format(j=j)] = (inter, h)
            shapes[up.format(j=j)] = (inter, h)
            shapes[down.format(j=j)] = (h, inter)
        if spec.shared_size:
            sh, n = p + "shared_expert.", spec.shared_size
            shapes.update({sh + "gate_proj.weight": (n, h), sh + "up_proj.weight": (n, h)})
            shapes[sh + "down_proj.weight"] = (h, n)
            shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


# Mixtral's GGUF is a `llama` file with experts (checkpoints/gguf/arch.py tells them apart)
_GGUF = {moe_config.QWEN2_MOE: "qwen2moe", moe_config.QWEN3_MOE: "qwen3moe", OLMOE: "olmoe"}
ARCHITECTURES = tuple(
    Architecture(name, (model_type,), moe_config.read_config, MoeModel, _GGUF.get(name))
    for model_type, name in moe_config.MODEL_TYPES.items()
)
