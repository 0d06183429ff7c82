"""A mixture-of-experts GGUF's experts served from the file's blocks (`--weights quantized`).

Each expert is its contiguous slice of the [E, rows, row bytes] tensor: computed alone it
equals its de-quantized float32 matrix; served, a Q8_0 Qwen3-MoE file (written here with
the `gguf` package, as tests/test_moe_gguf.py writes Q4_K and Q6_K ones) gives the float32
path's tokens and log-probabilities to float rounding, and transformers' greedy tokens;
a Mixtral (a `llama` file with experts) and an OLMoE written as llama.cpp writes them give
transformers' tokens on the floats of their blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.kernels.native.linear_quant import LinearQuant, QuantTensor, linear_quant
from pdserve.model.arch.moe import MoeModel
from pdserve.model.layers.quant_experts import QuantExperts
from pdserve.model.weights import resident_bytes
from tests.conftest import greedy_of
from tests.gguf_files import _tokenizer_metadata, llama_cpp_permute
from tests.test_moe_gguf import (
    _ATTN,
    _GLOBAL,
    NEW,
    PROMPTS,
    VOCAB,
    _hf_greedy,
    _put,
    _reinit,
    write_moe_gguf,
)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

E, HIDDEN, INTER = 4, 256, 512


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def kernel(cache: Path) -> LinearQuant:
    k = linear_quant(cache / "native")
    if k is None:
        pytest.skip("linear_quant not built (no C compiler)")
    return k


def _quantized(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> QuantTensor:
    """Random float32 weights of `shape` [E, rows, cols] quantized by gguf."""
    w = (rng.standard_normal(shape) / shape[-1] ** 0.5).astype(np.float32)
    q = GGMLQuantizationType[qtype]
    blocks = gguf_quants.quantize(w.reshape(-1, shape[-1]), q).reshape(*shape[:2], -1)
    return QuantTensor(qtype, torch.from_numpy(blocks), int(q), shape[-1])


def _floats(t: QuantTensor) -> torch.Tensor:
    q = GGMLQuantizationType(t.type_id)
    return torch.from_numpy(np.asarray(gguf_quants.dequantize(t.data.numpy(), q), np.float32))


def _act_mul(h: torch.Tensor) -> torch.Tensor:
    return F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2 :]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_each_expert_computes_its_own_slice(kernel: LinearQuant, qtype: str) -> None:
    rng = np.random.default_rng(0)
    gate, up = (_quantized((E, INTER, HIDDEN), qtype, rng) for _ in range(2))
    down = _quantized((E, HIDDEN, INTER), qtype, rng)
    experts = QuantExperts(gate, up, down, kernel)
    g, u, d = _floats(gate), _floats(up), _floats(down)
    # a decode's token per expert, the register kernels' few, a prompt's; expert 1 unrouted
    for rows in (1, 3, 40):
        counts = [0 if e == 1 else rows + e for e in range(E)]
        x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(rows))
        got = experts(x, counts, _act_mul)
        start = 0
        for e, n in enumerate(counts):
            xe = x[start : start + n]
            want = _act_mul(torch.cat([xe @ g[e].t(), xe @ u[e].t()], 1)) @ d[e].t()
            torch.testing.assert_close(got[start : start + n], want, rtol=1e-4, atol=1e-4)
            start += n


def _run(path: Path, weights: str) -> tuple[list[tuple[list[int], object]], int, bool]:
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128, weights=weights)
    try:
        model = llm.decode.runner.model
        assert isinstance(model, MoeModel)
        on_blocks = all(x.experts.quant is not None for x in model.layers if x.experts)
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=True)
        outs = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
        return outs, resident_bytes(model), on_blocks
    finally:
        llm.close()


def test_quantized_experts_equal_float32_experts_and_transformers(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    from pdserve.checkpoints.resolve import resolve_model

    path = write_moe_gguf(tmp_path / "qwen3moe-Q8_0.gguf", "qwen3moe", "Q8_0")
    quant, quant_bytes, on_blocks = _run(path, "quantized")
    # the conversion left the experts' floats out (served from the blocks) ...
    weights = resolve_model(str(path)).path / "model.safetensors"
    assert (weights.parent / "experts.json").exists()
    without = weights.stat().st_size
    floats, float_bytes, float_on_blocks = _run(path, "float32")
    # ... and wrote them when --weights float32 needed them
    assert not (weights.parent / "experts.json").exists() and weights.stat().st_size > 2 * without
    assert on_blocks and not float_on_blocks
    # the experts are most of the weights: float32 holds about 32 / 8.5 of the blocks
    assert quant_bytes <= 1.2 * path.stat().st_size < float_bytes / 2.5
    for (q_ids, q_lp), (f_ids, f_lp) in zip(quant, floats, strict=True):
        assert q_ids == f_ids
        np.testing.assert_allclose(np.asarray(q_lp), np.asarray(f_lp), atol=1e-3)
    want = _hf_greedy(path)
    assert [ids for ids, _ in quant] == want
    assert any(len(set(w)) > 2 for w in want), want


def _llamacpp_model(family: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=256)  # fmt: skip
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4)
    else:
        cfg = transformers.OlmoeConfig(**common, num_experts=4, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _reinit(model)
    return model


def write_llamacpp_moe(path: Path, family: str, qtype: str) -> torch.nn.Module:
    """A Mixtral or OLMoE made by transformers, as llama.cpp's converter writes one:
    Mixtral a `llama` file with `expert_count`, Q/K rows permuted; OLMoE an `olmoe` file,
    its q/k norms over the whole projection; the router F32. Returns the model."""
    import gguf

    model = _llamacpp_model(family)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama" if family == "mixtral" else "olmoe")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_vocab_size(VOCAB)
    _tokenizer_metadata(w, VOCAB)
    rng = np.random.default_rng(0)
    heads = {"self_attn.q_proj.weight": 4, "self_attn.k_proj.weight": 2}
    for hf, t in model.state_dict().items():
        a = t.numpy()
        if hf in _GLOBAL:
            _put(w, _GLOBAL[hf], a, qtype, rng)
            continue
        _, _, layer, rest = hf.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate (w1) rows, then up (w3)
            half = a.shape[1] // 2
            _put(w, blk + "ffn_gate_exps.weight", np.ascontiguousarray(a[:, :half]), qtype, rng)
            _put(w, blk + "ffn_up_exps.weight", np.ascontiguousarray(a[:, half:]), qtype, rng)
        elif rest == "mlp.experts.down_proj":
            _put(w, blk + "ffn_down_exps.weight", a, qtype, rng)
        elif rest == "mlp.gate.weight":
            _put(w, blk + "ffn_gate_inp.weight", a, "F32", rng)
        else:
            if family == "mixtral" and rest in heads:
                a = llama_cpp_permute(a, heads[rest])
            _put(w, blk + _ATTN[rest], a, qtype, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_llamacpp_moe_gguf_experts_in_blocks_equal_transformers(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """transformers' GGUF loader reads neither file: the reference is its model class on
    the folder the file converts to (the blocks' floats), and the model the file was
    written from gives the same tokens (the names and row order map back)."""
    import transformers

    from pdserve.checkpoints.gguf import expert_floats
    from pdserve.checkpoints.resolve import resolve_model

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    path = tmp_path / f"{family}-Q8_0.gguf"
    original = write_llamacpp_moe(path, family, "Q8_0")
    ours, _, on_blocks = _run(path, "quantized")
    assert on_blocks
    folder = resolve_model(str(path)).path
    expert_floats.ensure(folder)  # transformers reads the experts' floats from the folder
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(hf) is type(original)
    want = [greedy_of(hf, p, NEW) for p in PROMPTS]
    assert [ids for ids, _ in ours] == want
    assert any(len(set(w)) > 2 for w in want), want
    assert [greedy_of(original, p, NEW) for p in PROMPTS] == want


def test_int8_experts_are_one_int8_call_per_expert(cache: Path, kernel: LinearQuant) -> None:
    """--quant-activations int8 reaches the experts: the grouped calls equal each expert's
    own integer projections (x quantized per row, so a slice of the batch's quantized rows
    is the slice's own), and differ from the float-activation experts."""
    k8 = linear_quant(cache / "native", int8=True)
    assert k8 is not None
    rng = np.random.default_rng(1)
    gate, up = (_quantized((E, INTER, HIDDEN), "Q4_0", rng) for _ in range(2))
    down = _quantized((E, HIDDEN, INTER), "Q8_0", rng)
    counts = [2, 0, 1, 5]
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3))
    got = QuantExperts(gate, up, down, k8)(x, counts, _act_mul)
    start = 0
    for e, n in enumerate(counts):
        xe = x[start : start + n].contiguous()
        h = torch.empty(n, 2 * INTER)
        for t, col in ((gate, 0), (up, INTER)):
            k8(xe, t.data[e], t.type_id, None, h, col, k8.quantize(xe))
        act = _act_mul(h).contiguous()
        want = torch.empty(n, HIDDEN)
        k8(act, down.data[e], down.type_id, None, want, 0, k8.quantize(act))
        assert torch.equal(got[start : start + n], want), e
        start += n
    assert not torch.equal(got, QuantExperts(gate, up, down, kernel)(x, counts, _act_mul))
