"""Small GGUF files written the way llama.cpp's converter writes them, for tests.

`write_llama_gguf` takes a random Llama made by pdserve's own preset code (so its
greedy tokens are confident), quantizes its matrices to the requested type with
the `gguf` package, permutes the Q/K rows as llama.cpp does, and stores the
byte-level BPE tokenizer as GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import torch

from pdserve.checkpoints import presets as make
from pdserve.checkpoints import tokenizer_build as tb
from tests.conftest import greedy_of

# Rows of 128 (a multiple of every block size used here: 32).
PRESET = make.ModelPreset(
    "LlamaForCausalLM",
    num_layers=2,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=50000.0,
)
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",  # Qwen2
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_BLOCK_NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, rotate-half rows become interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_metadata(w: gguf.GGUFWriter, vocab_size: int) -> None:
    model = json.loads(tb.build_tokenizer(vocab_size).to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    specials = {tb.special_token_id(s) for s in tb.SPECIAL_TOKENS}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(tb.special_token_id(tb.BOS_TOKEN))
    w.add_eos_token_id(tb.special_token_id(tb.IM_END))
    w.add_add_bos_token(False)
    w.add_chat_template(tb.CHAT_TEMPLATE)


def _add(w: gguf.GGUFWriter, name: str, t: np.ndarray, qtype: str) -> None:
    if t.ndim == 1 or qtype == "F32":  # llama.cpp keeps norms in F32
        w.add_tensor(name, t.astype(np.float32))
    elif qtype == "F16":
        w.add_tensor(name, t.astype(np.float16))
    elif qtype == "F64":  # a type gguf stores but does not de-quantize
        w.add_tensor(name, t.astype(np.float64))
    else:
        q = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), q), raw_dtype=q)


def write_llama_gguf(
    path: Path,
    qtype: str,
    *,
    arch: str = "llama",
    tied: bool = False,
    odd_tensor: tuple[str, str] | None = None,  # (gguf name, type) of one tensor to override
) -> Path:
    """A GGUF of PRESET (seed 0, untied unless `tied`) with matrices in `qtype`.

    `arch` other than llama/qwen2/qwen3 writes a Llama under that architecture name."""
    arch_hf = _HF_ARCH.get(arch, "LlamaForCausalLM")
    p = dataclasses.replace(PRESET, architecture=arch_hf, tie_word_embeddings=tied)
    if arch == "qwen3":  # transformers reads no head size from a qwen3 GGUF: it assumes 128
        p = dataclasses.replace(p, hidden_size=256, num_heads=2, num_kv_heads=1)
    weights = make.init_weights(p, seed=0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("pdserve test llama")
    w.add_block_count(p.num_layers)
    w.add_context_length(p.max_position_embeddings)
    w.add_embedding_length(p.hidden_size)
    w.add_feed_forward_length(p.intermediate_size)
    w.add_head_count(p.num_heads)
    w.add_head_count_kv(p.num_kv_heads)
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.rms_norm_eps)
    w.add_rope_dimension_count(p.head_dim)
    w.add_key_length(p.head_dim)  # as llama.cpp writes it
    w.add_value_length(p.head_dim)
    w.add_vocab_size(p.vocab_size)
    _tokenizer_metadata(w, p.vocab_size)
    for hf, t in weights.items():
        name = gguf_name(hf)
        a = t.numpy()
        if arch != "llama":  # llama.cpp permutes Q/K rows of Llama only
            pass
        elif name.endswith("attn_q.weight"):
            a = llama_cpp_permute(a, p.num_heads)
        elif name.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, p.num_kv_heads)
        _add(w, name, a, odd_tensor[1] if odd_tensor and odd_tensor[0] == name else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_greedy_gguf(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, loading the GGUF itself (float32)."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return greedy_of(m, prompt, max_new_tokens)


# Byte offsets of the float16 scale fields (d, and dmin where there is one) in one block of
# each type, from gguf's de-quantizers; every other byte of a block is a bounded integer.
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}  # fmt: skip
RANDOM_PRESET = dataclasses.replace(  # rows of 256: every block size divides them
    PRESET, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
)


def _set_scales(blocks: np.ndarray, qtype: str, scale: np.ndarray) -> None:
    """Write per-block scales (float) into `blocks` (n, type_size) in place."""
    if qtype in _F16_FIELDS:
        for off in _F16_FIELDS[qtype]:
            blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    elif qtype == "IQ1_M":  # d is spread over the top nibbles of the last four uint16 words
        bits = scale.astype(np.float16).view(np.uint16)
        words = blocks[:, -8:].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[:, -8:] = words.view(np.uint8)
    elif qtype == "MXFP4":  # an E8M0 exponent byte: 2**(e - 127) / 2
        blocks[:, 0] = np.clip(np.round(np.log2(scale * 2) + 127), 1, 254).astype(np.uint8)
    elif qtype == "NVFP4":  # four unsigned E4M3 bytes; the subnormal ones are m * 2**-10
        m = np.clip(np.round(scale * 1024), 1, 7).astype(np.uint8)
        blocks[:, :4] = m[:, None]
    else:
        raise ValueError(qtype)


def random_blocks(
    qtype: str, shape: tuple[int, int], rng: np.random.Generator, std: float = 0.05
) -> np.ndarray:
    """A (rows, bytes) array of random `qtype` blocks whose values have about `std`:
    random bytes with finite scales are valid blocks."""
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = shape
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    unit = rng.uniform(0.5, 1.5, n).astype(np.float32)
    _set_scales(blocks, qtype, unit * (0.004 if qtype in ("MXFP4", "NVFP4") else 1.0))
    if qtype not in ("MXFP4", "NVFP4"):  # scales act linearly: aim at `std`
        got = float(gguf.quants.dequantize(blocks, q).std())
        _set_scales(blocks, qtype, unit * (std / got))
    values = gguf.quants.dequantize(blocks, q)
    assert np.isfinite(values).all() and 0 < np.abs(values).max() < 10, qtype
    return blocks.reshape(rows, cols // block * size)


def _random_tensor(
    shape: tuple[int, ...], qtype: str, rng: np.random.Generator, std: float
) -> np.ndarray:
    if len(shape) == 1:  # llama.cpp keeps norms in F32
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    values = (std * rng.standard_normal(shape)).astype(np.float32)
    if qtype == "F32":
        return values
    if qtype == "F16":
        return values.astype(np.float16)
    if qtype == "BF16":
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
    return random_blocks(qtype, shape, rng, std)  # type: ignore[arg-type]


def write_random_gguf(path: Path, qtype: str, seed: int = 0, rows: int | None = None) -> Path:
    """A Llama GGUF of RANDOM_PRESET whose matrices are random `qtype` data; `rows` makes
    the embedding and output matrices that tall (a large file; the tokenizer stays small)."""
    p = RANDOM_PRESET
    rng = np.random.default_rng(seed)
    shapes = {hf: tuple(t.shape) for hf, t in make.init_weights(p, seed=0).items()}
    if rows is not None:
        for hf in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[hf] = (rows, p.hidden_size)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(p.num_layers)
    w.add_context_length(p.max_position_embeddings)
    w.add_embedding_length(p.hidden_size)
    w.add_feed_forward_length(p.intermediate_size)
    w.add_head_count(p.num_heads)
    w.add_head_count_kv(p.num_kv_heads)
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.rms_norm_eps)
    w.add_vocab_size(rows or p.vocab_size)
    _tokenizer_metadata(w, p.vocab_size)
    for hf, shape in shapes.items():
        # large Q and K make attention peaked, so the tokens depend on the Q/K row order
        std = 0.25 if ".q_proj." in hf or ".k_proj." in hf else 0.05
        t = _random_tensor(shape, qtype, rng, std)
        raw = (
            None if len(shape) == 1 or qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype]
        )
        w.add_tensor(gguf_name(hf), t, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
