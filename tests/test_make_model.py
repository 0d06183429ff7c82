"""Reference checkpoints: transformers loads them, they are deterministic, the tokenizer
round-trips any UTF-8, and the default-model cache builds once even under a race."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.checkpoints import presets as make
from pdserve.checkpoints import tokenizer_build as tb

transformers = pytest.importorskip("transformers")

TINY_PRESETS = ["tiny", "tiny-llama3", "tiny-qwen2", "tiny-qwen3"]
PROMPTS = ["def main(argv):\n    return", "The quick brown fox jumps", "你好，世界 🌍 1 2 3"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """preset -> folder, each preset made once per module (seed 0)."""
    root, made = tmp_path_factory.mktemp("ckpt"), dict[str, Path]()

    def get(preset: str) -> Path:
        if preset not in made:
            made[preset] = make.make_model(preset, root / preset)
        return made[preset]

    return get


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_transformers_loads_and_generates(preset: str, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(preset)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched weights
    assert type(model).__name__ == make.PRESETS[preset].architecture
    assert model.dtype == torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == model.config.eos_token_id == tb.special_token_id(tb.EOS_TOKEN)
    assert tok.bos_token_id == model.config.bos_token_id
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 24
    assert min(new) >= len(tb.SPECIAL_TOKENS), "special token emitted by chance"
    assert len(set(new)) > 3, "degenerate: same token over and over"


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_logits_are_confident(preset: str, checkpoint: Callable[[str], Path]) -> None:
    """Greedy must not hinge on fp32 noise: top-1/top-2 gaps above 1e-3 almost always."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(preset))
    tok = tb.build_tokenizer(make.PRESETS[preset].vocab_size)
    gaps = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = torch.tensor([tok.encode(text).ids])
            logits = model(ids).logits[0]
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
            # special tokens (EOS included) are pushed far below the rest
            n = len(tb.SPECIAL_TOKENS)
            assert logits[:, :n].abs().max() < 0.25 * logits[:, n:].std()
    gap = torch.cat(gaps)
    assert (gap < 1e-3).float().mean() < 0.05
    assert gap.median() > 0.1


def test_context_changes_the_continuation(checkpoint: Callable[[str], Path]) -> None:
    """Attention matters: changing an early prompt token changes later greedy tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint("tiny"))
    ids = torch.tensor([tb.build_tokenizer(4096).encode(PROMPTS[1] * 4).ids])
    other = ids.clone()
    other[0, 0] += 1
    gen = [model.generate(x, max_new_tokens=8, do_sample=False)[0, -8:] for x in (ids, other)]
    assert not torch.equal(gen[0], gen[1])


def test_special_weights_per_architecture() -> None:
    qwen2 = make.init_weights(make.PRESETS["tiny-qwen2"], seed=0)
    assert "lm_head.weight" not in qwen2 and "model.layers.0.self_attn.q_proj.bias" in qwen2
    qwen3 = make.init_weights(make.PRESETS["tiny-qwen3"], seed=0)
    assert qwen3["model.layers.3.self_attn.k_norm.weight"].shape == (32,)
    assert "lm_head.weight" in qwen3 and "model.layers.0.self_attn.q_proj.bias" not in qwen3
    assert all(t.dtype == torch.float32 for t in qwen3.values())
    cfg = make.hf_config(make.PRESETS["tiny-llama3"])
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    a = make.make_model("tiny", tmp_path / "a", seed=7)
    b = make.make_model("tiny", tmp_path / "b", seed=7)
    c = make.make_model("tiny", tmp_path / "c", seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    weights = "model.safetensors"
    assert (a / weights).read_bytes() != (c / weights).read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


UTF8_SAMPLES = [
    "plain ascii",
    "  leading and trailing spaces  ",
    "中文字符和日本語のテキスト、한국어",
    "emoji 🌍🎉👩‍👩‍👧 flags 🇯🇵",
    "control \x00\x01\x07\x1b[31m\t\r\n\x7f",
    "combining e\u0301 and NFC é, RTL \u202e",
    tb.EOS_TOKEN + "<|im_start|>user",
]


@pytest.mark.parametrize("vocab", [4096])
def test_tokenizer_round_trips_samples(vocab: int) -> None:
    tok = tb.build_tokenizer(vocab)
    assert tok.get_vocab_size() == vocab
    for text in UTF8_SAMPLES:
        ids = tok.encode(text).ids
        assert all(0 <= i < vocab for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_training_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    first = tb.build_tokenizer(4096).to_str()
    monkeypatch.setattr(tb, "_TRAINED", {})  # force a second training run
    assert tb.build_tokenizer(4096).to_str() == first


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=64))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tok = tb.build_tokenizer(4096)
    ids = tok.encode(text).ids
    assert all(0 <= i < 4096 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_chatml(checkpoint: Callable[[str], Path]) -> None:
    cfg = json.loads((checkpoint("tiny") / "tokenizer_config.json").read_text())
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = jinja2.Environment().from_string(cfg["chat_template"])
    rendered = text.render(messages=messages, add_generation_prompt=True)
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert rendered == expected + "<|im_start|>assistant\n"
    assert text.render(messages=messages, add_generation_prompt=False) == expected
    ids = tb.build_tokenizer(4096).encode(rendered).ids
    assert ids.count(tb.special_token_id(tb.IM_START)) == 3
    assert ids.count(tb.special_token_id(tb.IM_END)) == 2


def test_default_model_path_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = make.default_model_path("tiny")
    versioned = tmp_path / "models" / f"v{make.FORMAT_VERSION}"
    assert first == versioned / "tiny" and (first / "model.safetensors").is_file()

    def no_rebuild(*args: object, **kwargs: object) -> Path:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(make, "make_model", no_rebuild)
    assert make.default_model_path("tiny") == first


def test_default_model_path_race_builds_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two racing callers (separate flock descriptions) see one build and one folder."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    real, builds = make.make_model, []

    def slow_make(preset: str, out: Path, seed: int = 0) -> Path:
        builds.append(out)
        time.sleep(0.3)  # widen the window in which the other caller arrives
        return real(preset, out, seed)

    monkeypatch.setattr(make, "make_model", slow_make)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(make.default_model_path("tiny")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1]
    assert len(builds) == 1
    versioned = tmp_path / "models" / f"v{make.FORMAT_VERSION}"
    assert [p.name for p in versioned.iterdir() if p.is_dir()] == [results[0].name]


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="pdserve")
    make.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", "--preset", "tiny-qwen3", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["make-model", "--help"])
    assert exc.value.code == 0
    assert "tiny-llama3" in capsys.readouterr().out
