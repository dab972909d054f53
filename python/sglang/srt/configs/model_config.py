"""ModelConfig: the HF config of a checkpoint plus what the runtime derives from it."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from sglang.srt.utils.common import str_to_dtype

logger = logging.getLogger(__name__)

DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def load_hf_config(model_path: str, trust_remote_code: bool = False):
    import os

    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model config at {model_path!r}: {e}") from e


def rope_parameters_of(hf_config) -> dict[str, Any]:
    """The rope dict of a config in transformers-5 form (`rope_parameters`), accepting the older
    `rope_scaling` + `rope_theta` spelling that DeepSeek checkpoints ship."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def apply_overrides(hf_config, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        setattr(hf_config, key, value)


class ModelConfig:
    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        context_length: int | None = None,
        json_model_override_args: str | dict | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        from sglang.srt.model_loader.builtin import resolve_model_path

        self.model_path = resolve_model_path(model_path)
        self.hf_config = load_hf_config(self.model_path, trust_remote_code)
        overrides = json_model_override_args or {}
        if isinstance(overrides, str):
            overrides = json.loads(overrides) if overrides.strip() else {}
        self.overrides = overrides
        apply_overrides(self.hf_config, overrides)

        cfg = self.hf_config
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json at {self.model_path} has no 'architectures' entry")
        self.architecture: str = archs[0]
        self.dtype: torch.dtype = self._resolve_dtype(dtype)
        max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
        if context_length is not None and context_length > max_pos:
            raise ValueError(
                f"--context-length {context_length} exceeds the model's max_position_embeddings {max_pos}")
        self.context_len: int = int(context_length or max_pos)
        self.vocab_size: int = int(cfg.vocab_size)
        self.hidden_size: int = int(cfg.hidden_size)
        self.num_hidden_layers: int = int(cfg.num_hidden_layers)
        self.is_dsa: bool = self.architecture in DSA_ARCHITECTURES
        self.kv_lora_rank: int = int(getattr(cfg, "kv_lora_rank", 0) or 0)
        self.qk_rope_head_dim: int = int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
        self.index_head_dim: int = int(getattr(cfg, "index_head_dim", 0) or 0) if self.is_dsa else 0
        self.index_topk: int = int(getattr(cfg, "index_topk", 2048) or 2048) if self.is_dsa else 0
        self.quant_config: dict | None = getattr(cfg, "quantization_config", None)
        if self.quant_config is not None and not isinstance(self.quant_config, dict):
            self.quant_config = self.quant_config.to_dict()
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    def _resolve_dtype(self, dtype: str) -> torch.dtype:
        if dtype != "auto":
            return str_to_dtype(dtype)
        cfg_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(cfg_dtype, torch.dtype):
            return cfg_dtype
        if isinstance(cfg_dtype, str):
            return str_to_dtype(cfg_dtype)
        return torch.bfloat16

