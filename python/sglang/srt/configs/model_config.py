"""ModelConfig: the HF config of a checkpoint plus what the runtime derives from it."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch

from sglang.srt.configs.index_layers import (
    IndexLayerSchedule,
    IndexScheduleError,
    config_index_settings,
    resolve_index_layer_schedule,
)
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


# Structural sizes that must stay >= 1 whatever the override (0 or less cannot build a model).
POSITIVE_CONFIG_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
    "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim", "qk_head_dim", "n_group",
    "topk_group", "max_position_embeddings", "index_topk", "index_head_dim", "index_n_heads"})


class ConfigOverrideError(ValueError):
    """A --json-model-override-args value the config cannot take."""

    def __init__(self, key: str, reason: str) -> None:
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


def check_override(key: str, value: Any, current: Any) -> None:
    """An override must keep the type of the value it replaces (ints may become floats), be
    finite, keep non-negative integers non-negative and structural sizes positive. Keys the
    config does not have (e.g. IndexCache settings) are only checked for finiteness."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigOverrideError(key, f"must be finite, got {value!r}")
    if current is not None:
        kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
        want = next((k for t, k in kinds.items() if type(current) is t), None)
        if want is not None and (not isinstance(value, want) or (isinstance(value, bool) and bool not in want)):
            raise ConfigOverrideError(key, f"must be {want[-1].__name__} like the config's {current!r}, "
                                      f"got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if key in POSITIVE_CONFIG_KEYS and value < 1:
            raise ConfigOverrideError(key, f"must be a positive integer, got {value}")
        if isinstance(current, int) and not isinstance(current, bool) and current >= 0 and value < 0:
            raise ConfigOverrideError(key, f"must be >= 0, got {value}")


def apply_overrides(hf_config, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        check_override(key, value, getattr(hf_config, key, None))
        setattr(hf_config, key, value)


class ModelConfig:
    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        context_length: int | None = None,
        json_model_override_args: str | dict | None = None,
        trust_remote_code: bool = False,
        index_topk_freq: int | None = None,
        index_topk_offset: int | None = None,
        index_topk_pattern: str | None = None,
        is_draft_model: bool = False,
    ) -> None:
        from sglang.srt.model_loader.builtin import resolve_model_path

        self.model_path = resolve_model_path(model_path)
        self.hf_config = load_hf_config(self.model_path, trust_remote_code)
        overrides = json_model_override_args or {}
        if isinstance(overrides, str):
            overrides = json.loads(overrides) if overrides.strip() else {}
        self.overrides = overrides
        checkpoint_index_settings = config_index_settings(self.hf_config)
        apply_overrides(self.hf_config, overrides)

        cfg = self.hf_config
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json at {self.model_path} has no 'architectures' entry")
        self.architecture: str = archs[0]
        self.is_draft_model = is_draft_model
        if is_draft_model and not self.architecture.endswith("NextN"):
            self.architecture += "NextN"  # the checkpoint's MTP layer, as its own one-layer model
        self.dtype: torch.dtype = self._resolve_dtype(dtype)
        max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
        if context_length is not None and context_length > max_pos:
            raise ValueError(
                f"--context-length {context_length} exceeds the model's max_position_embeddings {max_pos}")
        self.context_len: int = int(context_length or max_pos)
        self.vocab_size: int = int(cfg.vocab_size)
        self.hidden_size: int = int(cfg.hidden_size)
        self.num_attention_heads: int = int(getattr(cfg, "num_attention_heads", 1) or 1)
        self.num_hidden_layers: int = int(cfg.num_hidden_layers)
        self.is_dsa: bool = self.architecture.removesuffix("NextN") in DSA_ARCHITECTURES
        self.kv_lora_rank: int = int(getattr(cfg, "kv_lora_rank", 0) or 0)
        self.qk_rope_head_dim: int = int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
        self.qk_nope_head_dim: int = int(getattr(cfg, "qk_nope_head_dim", 0) or 0)
        self.v_head_dim: int = int(getattr(cfg, "v_head_dim", 0) or 0)
        self.index_head_dim: int = int(getattr(cfg, "index_head_dim", 0) or 0) if self.is_dsa else 0
        self.index_topk: int = int(getattr(cfg, "index_topk", 2048) or 2048) if self.is_dsa else 0
        self.index_n_heads: int = int(getattr(cfg, "index_n_heads", 64) or 64) if self.is_dsa else 0
        self.index_layer_schedule: IndexLayerSchedule | None = None
        if self.is_dsa:
            flags = {"index_topk_freq": index_topk_freq, "index_skip_topk_offset": index_topk_offset,
                     "index_topk_pattern": index_topk_pattern}
            self.index_layer_schedule = resolve_index_layer_schedule(
                self.num_hidden_layers, [("flags", flags), ("overrides", overrides),
                                         ("config", checkpoint_index_settings)])
            # Everything downstream reads the resolved schedule from the config.
            cfg.index_layer_schedule = self.index_layer_schedule
            cfg.indexer_types = self.index_layer_schedule.indexer_types()
        # The KV pool layout: every decoder layer has MLA KV; index K only where the indexer runs.
        self.num_kv_layers = 1 if is_draft_model else self.num_hidden_layers
        self.kv_index_layer_ids: list[int] = []
        if self.is_dsa:
            self.kv_index_layer_ids = [0] if is_draft_model else self.index_layer_schedule.full_layer_ids
        if not self.is_dsa and any(v is not None for v in (index_topk_freq, index_topk_offset, index_topk_pattern)):
            raise IndexScheduleError("index_topk_freq", f"IndexCache needs a DSA model; {self.architecture} has "
                                     "no indexer")
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



_SCHEDULE_FLAGS = {"index_topk_freq": "nsa_index_topk_freq", "index_skip_topk_offset": "nsa_index_topk_offset",
                   "index_topk_pattern": "nsa_index_topk_pattern", "indexer_types": "json_model_override_args"}


def model_config_from_server_args(sa) -> "ModelConfig":
    """Build the ModelConfig for a ServerArgs and check the combinations that need the model
    (IndexCache schedule, TP divisibility, TBO); errors name the flag (ServerArgsError)."""
    from sglang.srt.errors import ServerArgsError

    try:
        mc = ModelConfig(sa.model_path, sa.dtype, sa.context_length, sa.json_model_override_args,
                         sa.trust_remote_code, sa.nsa_index_topk_freq, sa.nsa_index_topk_offset,
                         sa.nsa_index_topk_pattern)
    except IndexScheduleError as e:
        raise ServerArgsError(_SCHEDULE_FLAGS.get(e.key, "json_model_override_args"), e.reason) from None
    except ConfigOverrideError as e:
        raise ServerArgsError("json_model_override_args", str(e)) from None
    except (ValueError, FileNotFoundError) as e:
        flag = "context_length" if "--context-length" in str(e) else "model_path"
        raise ServerArgsError(flag, str(e).replace("--context-length ", "")) from None
    from sglang.srt.models.registry import resolve_model_class

    try:
        resolve_model_class(mc.architecture)
    except ValueError as e:
        raise ServerArgsError("model_path", str(e)) from None
    heads = mc.hf_config.num_attention_heads
    attn_tp = 1 if sa.enable_nsa_prefill_context_parallel else sa.tp_size  # CP replicates attention
    if heads % attn_tp:
        raise ServerArgsError("tp_size", f"{sa.tp_size} does not divide num_attention_heads {heads}")
    experts = getattr(mc.hf_config, "n_routed_experts", None) or 0
    if sa.ep_size > 1 and experts % sa.ep_size:
        raise ServerArgsError("ep_size", f"{sa.ep_size} does not divide n_routed_experts {experts}")
    if sa.ep_size == 1 and not sa.enable_nsa_prefill_context_parallel and experts:
        inter = mc.hf_config.moe_intermediate_size
        if inter % sa.tp_size:
            raise ServerArgsError("tp_size", f"{sa.tp_size} does not divide moe_intermediate_size {inter}")
    triton = [f for f in ("nsa_prefill_backend", "nsa_decode_backend") if getattr(sa, f) == "triton"]
    if mc.is_dsa and triton:
        idx_heads = mc.index_n_heads
        if idx_heads & (idx_heads - 1) or mc.index_head_dim & (mc.index_head_dim - 1):
            raise ServerArgsError(triton[0], f"the triton indexer needs power-of-two index_n_heads ({idx_heads}) "
                                  f"and index_head_dim ({mc.index_head_dim}); use torch")
        if sa.nsa_index_k_dtype == "fp8_e4m3" and mc.index_head_dim > 128:
            raise ServerArgsError(triton[0], f"the triton FP8 indexer needs index_head_dim <= 128 (got "
                                  f"{mc.index_head_dim}); use --nsa-index-k-dtype bfloat16 or torch")
    if getattr(sa, "kv_cache_dtype", "auto") == "fp8_e4m3":
        from sglang.srt.mem_cache.kv_fp8_format import check_dims

        try:
            check_dims(mc.kv_lora_rank, mc.qk_rope_head_dim)
        except ValueError as e:
            raise ServerArgsError("kv_cache_dtype", str(e)) from None
    from sglang.srt.layers.quantization.apply import QuantArgsError, get_quant_config

    try:  # the flags against the checkpoint's quantization_config (no tensor is read)
        get_quant_config(mc.model_path, sa.quantization, sa.dequantize_fp8_weights, sa.fp8_activation_dtype, "dummy")
    except QuantArgsError as e:
        raise ServerArgsError(e.flag, e.reason) from None
    if sa.enable_two_batch_overlap:
        if mc.index_layer_schedule is not None and mc.index_layer_schedule.shares:
            raise ServerArgsError(
                "enable_two_batch_overlap",
                f"cannot be combined with IndexCache top-k sharing (schedule {mc.index_layer_schedule.describe()}): "
                "the overlapped op path does not carry top-k indices across layers, so shared layers would run "
                "sparse attention with no indices. Use --nsa-index-topk-freq 1 or drop two-batch overlap.")
        raise ServerArgsError("enable_two_batch_overlap", "two-batch overlap is not implemented in this build "
                              "(it overlaps expert-parallel all-to-all, which needs several GPUs)")
    return mc
