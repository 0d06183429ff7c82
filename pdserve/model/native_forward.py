"""A decode engine's forward as one native call (kernels/native/decode_forward.py), where it fits.

`NativeDecodeForward.build` binds a model's weights, its KV pool and the rotary tables
into a plan once (a decode runner's warm-up); each pure decode step then fills in the
step's inputs and makes one ctypes call. It fits when the decode runs entirely on the
native kernels already (fp32 on the CPU, every projection on the native linear or in a
GGUF's blocks (linear_quant), the native norms and decode attention) with SiLU or
GELU-tanh, and its layer is Llama's or Gemma 3's (sandwich norms, a rope per layer type,
the embedding scaled; no logit soft-cap); otherwise `build` says why not and the
per-call path (LlamaModel.forward) runs, with the same results.

The per-call path computes the same values with the same kernels in the same order:
the logits are equal bit for bit (tests/test_decode_forward.py).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.kernels.core_share import CoreShare, HostCore
from pdserve.kernels.native.abi import (
    MAX_PARTS,
    MAX_WINDOWS,
    DecodeLayer,
    ExpertProj,
    MoeLayer,
    Proj,
    QuantProj,
)
from pdserve.kernels.native.decode_forward import DecodeForward, float_ptr
from pdserve.kernels.native.decode_ops import MAX_EXPERTS
from pdserve.model.arch import moe
from pdserve.model.arch.gemma3 import Gemma3Layer, Gemma3Model
from pdserve.model.arch.llama import LlamaModel
from pdserve.model.arch.moe_config import OLMOE
from pdserve.model.attention.backends import NativeAttention
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.layers.activations import NATIVE_ACTS
from pdserve.model.layers.linear import Linear
from pdserve.model.layers.ops import NativeOps
from pdserve.model.quant_weights import QuantEmbedding

if TYPE_CHECKING:
    from pdserve.kernels.native.linear_quant import QuantTensor
    from pdserve.model.arch.config import MoeSpec
    from pdserve.model.layers.quant_experts import QuantExperts


def refusal(model: LlamaModel, attn: object) -> str | None:
    """Why `model` cannot run its decode natively (None: it can)."""
    a = model.arch
    if isinstance(model, moe.MoeModel):
        why = moe_refusal(model)
        if why is not None:
            return why
    elif not computes_llama_layer(model) and type(model) is not Gemma3Model:
        return f"{a.architecture}'s layer is not the native forward's (Llama's or Gemma 3's)"
    if a.final_logit_softcapping is not None:
        return "the logits are soft-capped (final_logit_softcapping)"
    if a.rotary_dim not in (None, a.head_dim):
        return "rope turns part of each head (the native forward turns all of it)"
    if model.embed.dtype != torch.float32 or model.embed.device.type != "cpu":
        return "not fp32 on the CPU"
    if model.embed_quant is not None and not isinstance(model.embed_quant, QuantEmbedding):
        return "the embedding is looked up by a function the native forward does not know"
    if not isinstance(model.ops, NativeOps) or model.act not in NATIVE_ACTS:
        return "the native norms are off or the activation is neither SiLU nor GELU-tanh"
    if not all(lin.native is not None or lin.quant is not None for lin in model.linears()):
        return "a projection is not on the native linear"
    if any(lin.quant is not None and len(lin.quant[1]) > MAX_PARTS for lin in model.linears()):
        return f"a projection in GGUF blocks has more than {MAX_PARTS} parts"
    if not isinstance(attn, NativeAttention):
        return "the native decode attention is off"
    if len({attn.window(i) for i in range(a.num_layers)}) > MAX_WINDOWS:
        return f"more than {MAX_WINDOWS} distinct attention windows"
    return None


def moe_refusal(model: moe.MoeModel) -> str | None:
    """Why a mixture-of-experts model's layers are not the native forward's (None: they are)."""
    a = model.arch
    if a.architecture == OLMOE:
        return "OLMoE's attention (q/k norms over the whole projection, clip_qkv) is not native"
    if type(model) is not moe.MoeModel:
        return f"{type(model).__name__} computes its own layer"
    spec = moe.spec_of(a)
    if spec.num_experts > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if any(x.experts is not None and x.experts.quant is None for x in model.layers):
        return "the experts are not in a GGUF's blocks (--weights quantized)"
    for x in model.layers:
        q = x.experts.quant if x.experts else None
        if q is not None and not _expert_shapes_fit(q, a.hidden_size):
            return "a layer's expert tensors disagree in their widths"
    return None


def _expert_shapes_fit(q: QuantExperts, hidden: int) -> bool:
    """gate and up: I rows of hidden; down: hidden rows of I (the plan trusts them)."""
    inter = q.gate.data.shape[1]
    return (q.gate.cols == q.up.cols == hidden and q.up.data.shape[1] == inter
            and q.down.data.shape[1] == hidden and q.down.cols == inter)  # fmt: skip


def computes_llama_layer(model: LlamaModel) -> bool:
    """Whether the model computes what LlamaModel computes: LlamaModel itself, or a class
    that says so of itself (not inherited: Phi-3's differs only in reading its checkpoint)."""
    cls = type(model)
    return cls is LlamaModel or bool(cls.__dict__.get("same_compute_as_llama", False))


def _proj(lin: Linear, keep: list[QuantProj]) -> Proj:
    """The plan's view of a projection; a QuantProj it points at is kept in `keep`."""
    if lin.quant is None:
        return Proj(float_ptr(lin.weight), float_ptr(lin.bias), lin.out_features,
                    lin.in_features, lin.weight.shape[0])  # fmt: skip
    q = QuantProj(parts=len(lin.quant[1]))
    for i, part in enumerate(lin.quant[1]):
        q.w[i], q.rows[i] = part.data.data_ptr(), part.data.shape[0]
        q.row_bytes[i], q.type[i] = part.data.shape[1], part.type_id
    keep.append(q)
    return Proj(0, float_ptr(lin.bias), lin.out_features, lin.in_features, 0, ctypes.pointer(q))


def _experts(e: moe.Experts, spec: MoeSpec, keep: list[object]) -> MoeLayer:
    """The plan's view of a sparse layer's MLP (its structs kept in `keep`)."""
    q = e.quant
    assert q is not None  # refusal: the experts are in blocks

    def blocks(t: QuantTensor) -> ExpertProj:
        assert t.data.is_contiguous()  # NOTE: expert e's rows at e * rows * row_bytes
        return ExpertProj(t.data.data_ptr(), t.data.shape[1], t.data.shape[2], t.type_id)

    parts: list[QuantProj] = []
    shared = [Proj() if lin is None else _proj(lin, parts)
              for lin in (e.shared_gate_up, e.shared_down, e.shared_gate)]  # fmt: skip
    m = MoeLayer(_proj(e.router, parts), blocks(q.gate), blocks(q.up), blocks(q.down), *shared,
                 spec.num_experts, spec.top_k, q.gate.data.shape[1], int(spec.norm_topk_prob))  # fmt: skip
    keep += [*parts, m]
    return m


def _int8(model: LlamaModel) -> bool:
    """--quant-activations int8: a projection's or an expert's kernel quantizes x."""
    if any(lin.quant is not None and lin.quant[0].int8 for lin in model.linears()):
        return True
    layers = model.layers if isinstance(model, moe.MoeModel) else []
    return any(x.experts is not None and x.experts.quant and x.experts.quant.kernel.int8
               for x in layers)  # fmt: skip


class NativeDecodeForward:
    def __init__(
        self,
        kernel: DecodeForward,
        model: LlamaModel,
        attn: NativeAttention,
        share: CoreShare | None,
        host: HostCore | None = None,
    ) -> None:
        """Precondition: refusal(model, attn) is None. `host`: the schedule thread's claim
        on a core (core_share.HostCore), read before every kernel; None: never claimed."""
        a, pool = model.arch, attn.pool
        self.kernel, self.model, self.attn = kernel, model, attn
        per_layer = [attn.window(i) for i in range(a.num_layers)]
        self.windows = sorted(set(per_layer))  # the plan's bounds[k] is windows[k]'s
        layers = (DecodeLayer * a.num_layers)()
        keep: list[QuantProj] = []
        self._quant = keep  # NOTE: the plan's Projs point into them: kept alive with the plan
        sparse: list[object] = []
        self._sparse = sparse  # NOTE: the plan's layers point into them: kept alive with it
        for i, w in enumerate(model.layers):
            # Gemma 3's norms around each sublayer (None: the Llama layer)
            pre_ff, post_ff = (
                (w.pre_ff_norm, w.post_ff_norm) if isinstance(w, Gemma3Layer) else (None, None)
            )
            rope = model.ropes[model.rope_of_layer[i]]
            e = w.experts if isinstance(w, moe.MoeLayer) else None
            mlp = (Proj(), Proj()) if e else (_proj(w.gate_up, keep), _proj(w.down, keep))
            layers[i] = DecodeLayer(
                float_ptr(w.input_norm), float_ptr(w.post_norm), float_ptr(pre_ff),
                float_ptr(post_ff), float_ptr(w.q_norm),
                float_ptr(w.k_norm), float_ptr(rope.cos), float_ptr(rope.sin_signed),
                _proj(w.qkv, keep), _proj(w.o, keep), *mlp,
                float_ptr(pool.k[i]), float_ptr(pool.v[i]), self.windows.index(per_layer[i]),
                ctypes.pointer(_experts(e, moe.spec_of(a), sparse)) if e else None,
            )  # fmt: skip
        self._layers = layers  # NOTE: the plan points into it: kept alive with the plan
        p = self.plan = kernel.plan()
        p.layers, p.hidden, p.inter = a.num_layers, a.hidden_size, a.intermediate_size
        p.heads, p.kv_heads, p.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        p.vocab = a.vocab_size
        p.num_slots, p.max_pos = pool.k.shape[1], min(r.cos.shape[0] for r in model.ropes)
        p.eps, p.scale = a.rms_norm_eps, attn.scale
        p.act_mul = kernel.act_muls[NATIVE_ACTS[model.act]]
        if isinstance(model, Gemma3Model):  # a float32 scalar: the plan's float holds it exactly
            p.embed_scale = float(model.embed_scale)
        p.embed, p.final_norm = float_ptr(model.embed), float_ptr(model.norm)
        if isinstance(model.embed_quant, QuantEmbedding):
            blocks = model.embed_quant.tensor
            p.embed, p.embed_blocks = 0, blocks.data.data_ptr()
            p.embed_row_bytes, p.embed_type = blocks.data.shape[1], blocks.type_id
        p.head, p.layer = _proj(model.lm_head, keep), layers
        if isinstance(model, moe.MoeModel) and sparse:
            spec = moe.spec_of(a)
            p.moe_experts, p.moe_top_k = spec.num_experts, spec.top_k
            # the scratch's widths: the widest layer's, as its blocks have them
            moes = [m for m in sparse if isinstance(m, MoeLayer)]
            p.moe_inter = max(m.inter for m in moes)
            p.moe_shared = max(m.shared_down.k_dim for m in moes)
        if _int8(model):
            p.quant_x8 = kernel.quant_x8  # --quant-activations int8
        if share is not None:
            p.share, p.share_engines, p.share_slot, p.share_own = share.records()
        self.host = host  # NOTE: the plan points into it: kept alive with the plan
        if host is not None:
            p.host_busy = host.address()
        self._scratch = torch.empty(0)
        self._scratch_b = 0  # the largest batch the scratch was sized for

    @classmethod
    def build(
        cls,
        kernel: DecodeForward | None,
        model: LlamaModel,
        attn: object,
        share: CoreShare | None,
        host: HostCore | None = None,
    ) -> tuple[NativeDecodeForward | None, str | None]:
        """(the forward, None), or (None, why not)."""
        why = "the native decode forward was not built" if kernel is None else refusal(model, attn)
        blocks = any(lin.quant is not None for lin in model.linears())
        # a mixture of experts passed refusal with its experts in blocks
        blocks = blocks or model.embed_quant is not None or isinstance(model, moe.MoeModel)
        if why is None and kernel is not None and blocks and not kernel.kernels["quant_linear"]:
            why = "the GGUF blocks' kernel (linear_quant) was not built"
        if why is not None or kernel is None or not isinstance(attn, NativeAttention):
            return None, why
        return cls(kernel, model, attn, share, host), None

    def fits(self, batch: ForwardBatch) -> bool:
        """A pure decode step (one token per request), prepared."""
        return batch.is_decode and batch.attn_plan is not None

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of a prepared pure decode step (fits(batch))."""
        p, b = self.plan, batch.batch_size
        ids, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        slots = batch.out_cache_loc.contiguous()
        for t in (ids, positions, slots):
            assert t.dtype == torch.int64 and t.shape == (b,), "decode inputs: [B] int64"
        keys, bounds = self.attn.decode_keys(batch, self.windows)
        assert keys.dtype == torch.int64 and keys.stride(1) == 1 and keys.shape[0] == b
        # numpy's allocation keeps the GIL (torch.empty lets go of it; see host_bounds)
        logits = torch.from_numpy(np.empty((b, self.model.arch.vocab_size), np.float32))
        p.b, p.threads = b, torch.get_num_threads()
        p.ids, p.positions, p.out_slots = ids.data_ptr(), positions.data_ptr(), slots.data_ptr()
        p.slots, p.slot_stride = keys.data_ptr(), keys.stride(0)
        for i, t in enumerate(bounds):
            p.bounds[i] = t.data_ptr()
        p.scratch, p.logits = self._scratch_for(b), logits.data_ptr()
        self.kernel(p)  # NOTE: every tensor the plan points at is alive until it returns
        return logits

    def _scratch_for(self, b: int) -> int:
        """The scratch for b requests (grown, never shrunk; one step at a time uses it).
        Its size grows with b; the kernel is asked only when b exceeds every earlier
        step's (a ctypes call lets go of the GIL: attention.host_bounds)."""
        if b > self._scratch_b:
            need = self.kernel.scratch_floats(self.plan, b)
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.float32)
            self._scratch_b = b
        return self._scratch.data_ptr()
