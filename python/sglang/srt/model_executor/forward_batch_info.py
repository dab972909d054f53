"""ForwardBatch: the tensors one model forward needs, built by the scheduler from a batch.

Tokens of all requests are flattened. Every request contributes `extend_seq_lens[i]` new tokens
on top of `extend_prefix_lens[i]` tokens already in the KV cache; decode is the case where every
request adds one token. `seq_lens` are the KV lengths after this forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly on top of a cached prefix (chunked prefill too)
    DECODE = auto()  # one new token per request
    MIXED = auto()  # extend requests and decode requests in one forward
    IDLE = auto()  # no tokens on this rank (multi-rank padding)

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class CaptureHiddenMode(IntEnum):
    NULL = 0
    LAST = 1  # last token of each request (EAGLE draft input)
    FULL = 2  # every token


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, KV length after this forward
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    extend_seq_lens: torch.Tensor  # [B] new tokens per request
    extend_prefix_lens: torch.Tensor  # [B] cached tokens per request
    extend_start_loc: torch.Tensor  # [B] offset of each request's first token in the flat layout
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)

    # Logprobs: per request, the first position whose input logprob is wanted (-1: none).
    return_logprob: bool = False
    logprob_start_lens_cpu: list[int] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    return_all_logits: bool = False  # tests / scoring: logits for every input token

    sampling_info: "SamplingBatchInfo | None" = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    # Speculative decoding: the target's hidden states the NextN draft layer consumes ([T, H]).
    spec_hidden_states: torch.Tensor | None = None

    # Set by the model runner.
    req_to_token_pool: Any = None
    token_to_kv_pool: Any = None
    attn_backend: Any = None
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int] | torch.Tensor,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: str = "cpu",
        **kwargs: Any,
    ) -> "ForwardBatch":
        """Derive positions, seq lens and offsets from per-request prefix / extend lengths."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
        ) if extend_lens else torch.empty(0, dtype=torch.int64)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            forward_mode=forward_mode,
            batch_size=len(extend_lens),
            input_ids=ids.to(device),
            positions=positions.to(device),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            out_cache_loc=out_cache_loc.to(device),
            extend_seq_lens=t(extend_lens),
            extend_prefix_lens=t(prefix_lens),
            extend_start_loc=t(starts),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            **kwargs,
        )
