"""Architecture name (HF `architectures[0]`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("sglang.srt.models.deepseek_v2", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("sglang.srt.models.deepseek_v2", "GlmMoeDsaForCausalLM"),
    # NextN / MTP draft layers (speculative decoding): ModelConfig(is_draft_model=True) picks them.
    "DeepseekV3ForCausalLMNextN": ("sglang.srt.models.deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
    "DeepseekV32ForCausalLMNextN": ("sglang.srt.models.deepseek_nextn", "DeepseekV32ForCausalLMNextN"),
    "GlmMoeDsaForCausalLMNextN": ("sglang.srt.models.deepseek_nextn", "GlmMoeDsaForCausalLMNextN"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
