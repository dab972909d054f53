"""Validation of the model, runtime, memory and NSA / DSA kernel flags: a mixin of ServerArgs (reads its fields)."""

from __future__ import annotations

import json

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class ModelChecks(FlagChecks):
    def _check_model(self) -> None:
        if not self.model_path:
            raise ServerArgsError("model_path", "is required (an HF model directory or builtin:NAME)")
        self._choice("dtype")
        self._choice("load_format")
        if self.quantization is not None:
            self._choice("quantization")
        if self.fp8_activation_dtype is not None:
            self._choice("fp8_activation_dtype")
        if self.dequantize_fp8_weights and self.quantization is not None:
            raise ServerArgsError("dequantize_fp8_weights", f"conflicts with --quantization {self.quantization} (serve "
                                  "FP8 weights or dequantise them, not both)")
        self._positive("context_length")
        if self.json_model_override_args.strip():
            try:
                value = json.loads(self.json_model_override_args)
            except json.JSONDecodeError as e:
                raise ServerArgsError("json_model_override_args", f"not valid JSON ({e})") from None
            if not isinstance(value, dict):
                raise ServerArgsError("json_model_override_args", "must be a JSON object")

    def _check_runtime(self) -> None:
        self._choice("device")
        self._positive("tp_size", allow_none=False)
        self._positive("cuda_graph_max_bs", allow_none=False)
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ServerArgsError("device", "cuda requested but no CUDA device is visible")
        if self.random_seed is not None and (not isinstance(self.random_seed, int) or self.random_seed < 0):
            raise ServerArgsError("random_seed", f"must be a non-negative integer, got {self.random_seed!r}")

    def _check_memory(self) -> None:
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ServerArgsError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        self._positive("max_total_tokens")
        self._positive("page_size")
        self._positive("max_running_requests")
        if self.page_size is not None and self.page_size & (self.page_size - 1):
            raise ServerArgsError("page_size", f"must be a power of two, got {self.page_size}")
        if self.max_total_tokens is not None and self.page_size and self.max_total_tokens < self.page_size:
            raise ServerArgsError("max_total_tokens", f"must hold at least one page ({self.page_size} tokens)")

    def _check_nsa(self) -> None:
        for name in ("nsa_index_k_dtype", "kv_cache_dtype", "nsa_prefill_backend", "nsa_decode_backend",
                     "mla_attn_path", "moe_runner_backend"):
            self._choice(name)
        self._positive("nsa_index_topk_freq")
        self._positive("nsa_index_topk_offset")
        if self.nsa_index_topk_pattern is not None:
            bad = sorted(set(self.nsa_index_topk_pattern) - {"F", "S"})
            if bad or not self.nsa_index_topk_pattern:
                raise ServerArgsError("nsa_index_topk_pattern", f"must be a non-empty string of 'F' and 'S', got "
                                      f"{self.nsa_index_topk_pattern!r}")
            if self.nsa_index_topk_freq is not None:
                raise ServerArgsError("nsa_index_topk_pattern",
                                      "conflicts with --nsa-index-topk-freq; give one schedule")
