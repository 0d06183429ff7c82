"""Hugging Face architecture name -> the model class that computes it."""

from __future__ import annotations

from pdserve.model.arch.gemma3 import Gemma3Model
from pdserve.model.arch.gemma3_config import GEMMA3
from pdserve.model.arch.llama import LlamaModel

MODEL_REGISTRY: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,  # Mistral, Qwen2 and Qwen3 share the Llama layout
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    GEMMA3: Gemma3Model,
}
