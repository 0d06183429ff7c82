"""A `gemma3` GGUF served like transformers loading the same file: llama.cpp's tensor
names and its 1 + weight norms, head size, window and rope base from the metadata, the
rest Gemma3TextConfig's defaults; what transformers and llama.cpp would read differently
is refused by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import _add, _tokenizer_metadata, hf_greedy_gguf
from safetensors.torch import load_file

from pdserve.checkpoints.gguf import convert as gguf_convert
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from tests.test_config_conformance import _prompts
from tests.test_gemma3 import make_gemma3

NEW = 8
# llama.cpp's names of a Gemma 3 layer's tensors (gguf.constants MODEL_ARCH.GEMMA3)
_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    stem = hf.removesuffix(".weight")
    if stem in _GLOBAL:
        return _GLOBAL[stem] + ".weight"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}.weight"


def write_gemma3_gguf(root: Path, qtype: str, **keys: object) -> Path:
    """A random Gemma 3 (six layers: five slide over 6 keys, the sixth is full; head size
    256) as llama.cpp writes it; `keys`: extra gemma3.* metadata (dots as __)."""
    src = make_gemma3(
        root, f"src-{qtype}", num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, layer_types=None,
    )  # fmt: skip
    path = root / f"gemma3-{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(6)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(6)
    for key, value in keys.items():
        w.add_float32(f"gemma3.{key.replace('__', '.')}", float(value))  # type: ignore[arg-type]
    _tokenizer_metadata(w, 512)
    for hf, t in load_file(str(src / "model.safetensors")).items():
        a = t.numpy()
        if hf.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma's norms as 1 + weight
        _add(w, _gguf_name(hf), a, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_greedy_tokens_equal_transformers_on_the_same_gguf(tmp_path, monkeypatch, qtype):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gemma3_gguf(tmp_path, qtype)
    prompts = _prompts(7)
    want = [hf_greedy_gguf(path, p, NEW) for p in prompts]
    assert any(len(set(x)) > 2 for x in want), want
    llm = LLM(path, page_size=4, max_total_tokens=1024, max_context=256)
    try:
        assert llm.decode.runner.arch.layer_windows == (6, 6, 6, 6, 6, 0)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == want


def _meta(**overrides: object) -> dict:
    meta: dict[str, object] = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a"] * 4}
    for k in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        meta[f"gemma3.{k}"] = 8
    meta |= {"gemma3.attention.head_count": 2, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
             "gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 16}  # fmt: skip
    return meta | {k.replace("__", "."): v for k, v in overrides.items()}


def test_config_as_transformers_reads_the_metadata():
    cfg = gguf_convert.hf_config(_meta(), set())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["sliding_window"] == 16 and cfg["head_dim"] == 256
    assert cfg["rope_theta"] == 1e6  # Gemma3TextConfig's default without rope.freq_base
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and cfg["tie_word_embeddings"]


@pytest.mark.parametrize(
    "key, value, words",
    [("gemma3__rope__freq_base_swa", 100.0, "sliding layers' rope base"),
     ("gemma3__attention__sliding_window_pattern", 4, "every 6th layer"),
     ("gemma3__attention__key_length", 128, "query_pre_attn_scalar"),
     ("gemma3__rope__scaling__type", "linear", "rope scaling")],
)  # fmt: skip
def test_metadata_read_otherwise_by_llama_cpp_is_refused(key, value, words):
    with pytest.raises(gguf_convert.GGUFError, match=words) as e:
        gguf_convert.hf_config(_meta(**{key: value}), set())
    assert key.replace("__", ".") in str(e.value)


def test_norm_weights_stored_plus_one_are_shifted_back():
    from pdserve.checkpoints.gguf.gemma3 import value_fix

    w = np.array([1.5, 0.25], np.float32)
    assert value_fix("blk.0.post_ffw_norm.weight", w).tolist() == [0.5, -0.75]
    assert value_fix("blk.0.attn_q.weight", w) is w
    assert torch.equal(torch.from_numpy(value_fix("output_norm.weight", w)) + 1, torch.tensor(w))
