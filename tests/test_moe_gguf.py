"""`qwen3moe`, `qwen2moe` and `phi3` GGUF files served like transformers loads the same file.

Each file is written here with the `gguf` package the way llama.cpp's converter lays
it out (experts as one [E, rows, cols] tensor per projection, the router as
ffn_gate_inp, Qwen2-MoE's shared expert as ffn_*_shexp), from a random model made by
transformers, its matrices quantized. transformers' GGUF loader reads no expert width
from the file, so the experts have its config classes' default widths (768; Qwen2-MoE
1408, shared 5632): hidden 256 keeps them small and every K-quant block whole.
gguf quantizes Q8_0 itself; a K-quant file holds random blocks of the same shapes (gguf
has no K-quant quantizer), scaled like the model's weights, beside a Q8_0 embedding and
head (as llama.cpp's mixes keep those in a wider type). The experts are served from the
file's blocks (model/quant_experts.py; tests/test_moe_quant.py compares them with float32).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import greedy_of
from tests.gguf_files import _add, _tokenizer_metadata, random_blocks

VOCAB, HIDDEN, NEW = 512, 256, 8
PROMPTS = [[5, 17, 300, 42, 9, 100, 7, 250, 11], [3, 4]]
_ATTN = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _hf_greedy(path: Path) -> list[list[int]]:
    """transformers' greedy tokens of PROMPTS, the GGUF loaded once by its own loader."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return [greedy_of(m, p, NEW) for p in PROMPTS]


def _model(arch: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=256)  # fmt: skip
    if arch == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=64, norm_topk_prob=True)
    else:
        cfg = transformers.Qwen2MoeConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model)
    return model


def _reinit(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # far from the tiny init: clear top-1 gaps, every tensor matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                std = 1.0 if "embed" in name else 1.5 / p.shape[-1] ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)


_MEAN_Q = {"Q4_K": 7.5, "Q5_K": 15.5}  # the mean of a random block's unsigned quants


def _put(
    w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype: str, rng: np.random.Generator
) -> None:
    """`a` in `qtype`; a K-quant matrix ([rows, cols] or [E, rows, cols]) as random blocks."""
    if name in ("token_embd.weight", "output.weight") and qtype.endswith("_K"):
        qtype = "Q8_0"  # random blocks here would favour one token everywhere
    if a.shape[-1] % 256 and qtype.endswith("_K"):
        qtype = "Q8_0"  # rows a K-quant's 256 does not divide (Qwen2-MoE's 1408), as llama.cpp falls back
    if a.ndim == 1 or not qtype.endswith("_K"):
        _add(w, name, a, qtype)
        return
    cols = a.shape[-1]
    std = 1.5 / cols**0.5
    blocks = random_blocks(qtype, (a.size // cols, cols), rng, std)
    q = gguf.GGMLQuantizationType[qtype]
    if qtype in _MEAN_Q:  # d * scale * q - dmin * min: dmin = mean(q) * d centres it at 0
        size = gguf.GGML_QUANT_SIZES[q][1]
        per_block = blocks.reshape(-1, size)
        d = per_block[:, 0:2].copy().view(np.float16).astype(np.float32)
        per_block[:, 2:4] = (d * _MEAN_Q[qtype]).astype(np.float16).view(np.uint8)
    w.add_tensor(name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=q)


def write_moe_gguf(path: Path, arch: str, qtype: str) -> Path:
    model = _model(arch)
    rng = np.random.default_rng(0)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(model.model.layers[0].self_attn.head_dim)
    w.add_value_length(model.model.layers[0].self_attn.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_vocab_size(VOCAB)
    _tokenizer_metadata(w, VOCAB)
    for hf, t in model.state_dict().items():
        a = t.numpy()
        if hf in _GLOBAL:
            _put(w, _GLOBAL[hf], a, qtype, rng)
            continue
        _, _, layer, rest = hf.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            half = a.shape[1] // 2
            _put(w, blk + "ffn_gate_exps.weight", np.ascontiguousarray(a[:, :half]), qtype, rng)
            _put(w, blk + "ffn_up_exps.weight", np.ascontiguousarray(a[:, half:]), qtype, rng)
        elif rest == "mlp.experts.down_proj":
            _put(w, blk + "ffn_down_exps.weight", a, qtype, rng)
        elif rest == "mlp.shared_expert_gate.weight":  # llama.cpp stores it as [hidden]
            _add(w, blk + _ATTN[rest], a[0], "F32")
        else:  # the router stays F32, as llama.cpp's converter keeps it
            _put(w, blk + _ATTN[rest], a, "F32" if rest == "mlp.gate.weight" else qtype, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch, qtype",
    [("qwen3moe", "Q4_K"), ("qwen2moe", "Q6_K")],  # Q8_0: the Phi-3 test
)
def test_greedy_tokens_equal_transformers_on_the_same_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, qtype: str
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_moe_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype)
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.close()
    want = _hf_greedy(path)
    assert [o.token_ids for o in outs] == want
    assert any(len(set(w)) > 2 for w in want), want


def write_phi3_gguf(path: Path, qtype: str) -> Path:
    """A Phi-3 made by transformers, its fused q|k|v and gate|up as llama.cpp stores them."""
    import transformers

    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model)
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(128)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(32)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    _tokenizer_metadata(w, VOCAB)
    w.add_pad_token_id(0)  # Phi3Config's default pad id (32000) lies past this vocabulary
    names = {**_ATTN, "self_attn.qkv_proj.weight": "attn_qkv.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
    for hf, t in model.state_dict().items():
        if hf in _GLOBAL:
            _add(w, _GLOBAL[hf], t.numpy(), qtype)
        else:
            _, _, layer, rest = hf.split(".", 3)
            _add(w, f"blk.{layer}.{names[rest]}", t.numpy(), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_phi3_gguf_equals_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_phi3_gguf(tmp_path / "phi3-Q8_0.gguf", "Q8_0")
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.close()
    want = _hf_greedy(path)
    assert [o.token_ids for o in outs] == want
    assert any(len(set(w)) > 2 for w in want), want
