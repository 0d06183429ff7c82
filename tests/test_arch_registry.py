"""Adding an architecture is one module and one registration: a toy architecture,
defined and registered here, is served exactly against a reference.

The toy ("ToyForCausalLM") is Llama with its embedding output multiplied by
`embedding_multiplier` (the toy implements 2.5 and refuses any other value by name).
Multiplying the embedding output equals multiplying the embedding table, so the
reference is transformers' Llama on the same weights with the table scaled.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.checkpoints.gguf.arch import ARCHES
from pdserve.model.arch import llama_config, registry
from pdserve.model.arch.config import Architecture, ModelArch
from pdserve.model.arch.llama import LlamaModel
from pdserve.model.arch.rules import UnsupportedConfig, refuse
from tests.conftest import hf_greedy, model_path

TOY, SCALE = "ToyForCausalLM", 2.5


class ToyModel(LlamaModel):
    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed_rows(ids) * SCALE


def read_toy(cfg: dict[str, Any], eos: tuple[int, ...] = ()) -> ModelArch:
    if cfg.get("embedding_multiplier") != SCALE:
        raise refuse("embedding_multiplier", cfg.get("embedding_multiplier"), f"toy: {SCALE}")
    llama = {k: v for k, v in cfg.items() if k != "embedding_multiplier"}
    llama["architectures"] = ["LlamaForCausalLM"]
    return dataclasses.replace(llama_config.read_config(llama, eos), architecture=TOY)


TOY_ARCH = Architecture(TOY, ("toy",), read_toy, ToyModel)


@pytest.fixture
def toy_registered():
    registry.register(TOY_ARCH)
    yield
    registry.unregister(TOY)


def _toy_folders(tmp: Path) -> tuple[Path, Path]:
    """(the toy's folder, the reference Llama folder with the embedding table scaled)."""
    src = model_path("tiny")
    toy, ref = tmp / "toy", tmp / "ref"
    shutil.copytree(src, toy)
    shutil.copytree(src, ref)
    cfg = json.loads((src / "config.json").read_text())
    assert not cfg.get("tie_word_embeddings")  # a tied head would be scaled too
    cfg.update(architectures=[TOY], model_type="toy", embedding_multiplier=SCALE)
    (toy / "config.json").write_text(json.dumps(cfg))
    state = load_file(ref / "model.safetensors")
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * SCALE
    save_file(state, ref / "model.safetensors")
    return toy, ref


def test_a_registered_toy_is_served_exactly(toy_registered, tmp_path: Path) -> None:
    toy, ref = _toy_folders(tmp_path)
    llm = LLM(toy, max_total_tokens=1024, max_context=256)
    assert type(llm.decode.runner.model) is ToyModel
    prompt = [5, 17, 300, 42, 9, 1000]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    llm.close()
    assert out.token_ids == hf_greedy(ref, prompt, 12)
    assert out.token_ids != hf_greedy(model_path("tiny"), prompt, 12)  # the hook mattered


def test_the_toy_refuses_by_name_and_is_gone_once_unregistered(toy_registered, tmp_path) -> None:
    toy, _ = _toy_folders(tmp_path)
    cfg = json.loads((toy / "config.json").read_text())
    with pytest.raises(UnsupportedConfig, match="embedding_multiplier"):
        registry.arch_from_config({**cfg, "embedding_multiplier": 3.0})
    assert registry.arch_from_config({**cfg, "architectures": None}).architecture == TOY
    registry.unregister(TOY)
    with pytest.raises(ValueError, match=f"{TOY} is not supported"):
        registry.load_arch(toy)


def test_every_gguf_architecture_becomes_a_registered_one() -> None:
    named = {a.gguf: a.name for a in registry.ARCHITECTURES.values() if a.gguf}
    assert {k: v.hf_architecture for k, v in ARCHES.items()} == named
