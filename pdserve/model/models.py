"""Hugging Face architecture name -> the model class that computes it."""

from __future__ import annotations

from pdserve.model.gemma3 import Gemma3Model
from pdserve.model.gemma3_config import GEMMA3
from pdserve.model.llama import LlamaModel
from pdserve.model.moe import MoeModel
from pdserve.model.moe_config import MOE_ARCHS
from pdserve.model.phi3 import Phi3Model
from pdserve.model.phi3_config import PHI3

MODEL_REGISTRY: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,  # Mistral, Qwen2 and Qwen3 share the Llama layout
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    GEMMA3: Gemma3Model,
    PHI3: Phi3Model,
    **dict.fromkeys(MOE_ARCHS, MoeModel),
}
