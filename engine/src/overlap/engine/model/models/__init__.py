"""The forward of each model family, built from `model.layers`; `build_model` picks it by config.json's
architecture."""

from __future__ import annotations

from overlap.engine.model.models.gemma import Gemma2Model, GemmaModel
from overlap.engine.model.models.llama import LlamaModel, ModelParts
from overlap.engine.model.models.qwen3 import Qwen3Model

# Llama, Mistral, Qwen2 and Phi-3 are one decoder (RMSNorm, GQA attention with RoPE, SwiGLU); what tells them apart
# (biases, sliding windows, fused checkpoints, partial rotary) is settled by the loader. Qwen3 adds q/k norms.
MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": LlamaModel,
    "Phi3ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": Qwen3Model,
    # Mixtures of experts: the same decoders, a layer's MLP a sparse block where its weights hold experts
    "Qwen3MoeForCausalLM": Qwen3Model,
    "Qwen2MoeForCausalLM": LlamaModel,
    "MixtralForCausalLM": LlamaModel,
    # Gemma: the same decoder with Gemma's norms, GeGLU, scaled embeddings and soft-capping (models/gemma.py)
    "GemmaForCausalLM": GemmaModel,
    "Gemma2ForCausalLM": Gemma2Model,
    "Gemma3ForCausalLM": Gemma2Model,
    # gpt-oss: the Llama decoder with attention sinks, biases, alternating sliding layers and a biased sparse block
    # (its differences are the spec's and the weights', models/llama.py and layers/moe.py compute them)
    "GptOssForCausalLM": LlamaModel,
}


def build_model(parts: ModelParts) -> LlamaModel:
    return MODEL_CLASSES[parts.spec.architecture](parts)


__all__ = ["MODEL_CLASSES", "LlamaModel", "ModelParts", "build_model"]
