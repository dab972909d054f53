"""ForwardBatch: the tensors one model forward needs, built by the scheduler from a batch.

Tokens of all requests are flattened. Every request contributes `extend_seq_lens[i]` new tokens
on top of `extend_prefix_lens[i]` tokens already in the KV cache; decode is the case where every
request adds one token. `seq_lens` are the KV lengths after this forward.

All metadata is derived on the host from the scheduler's lists and uploaded in one pinned,
non-blocking copy (`ForwardBatch.build`); nothing in the forward reads it back. The host lists
(`*_cpu`) stay available for decisions that need values (sizes, chunking) without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.utils.common import upload

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
    # Every token as computed, for the EAGLE draft extend: under prefill CP this rank's rows in its
    # CP layout (no gather; the draft's CP split of the same batch is the same layout), else FULL.
    FULL_LOCAL = 3


@dataclass
class SpecInput:
    """Speculative decoding: what the NextN draft layer reads from the target's forward."""

    hidden_states: torch.Tensor  # [T, H] the target's hidden states
    # The top-k the target's last layer passed on ([T, index_topk], IndexCache sharing on): the draft
    # layer reuses it instead of scoring.
    topk_indices: torch.Tensor | None = None
    rows_local: bool = False  # both are already in this rank's CP layout (else the scheduler's order)


@dataclass
class CPBatchInfo:
    """Context parallel. `split_by_slot_owner` is the caller's: each token is computed by the owner
    of its KV page, for forwards over slots another forward's split placed (speculative: the draft's
    steps inside a verify's rows, one row of a verify allocation), which a fresh split of these rows
    could place differently. `metadata` is set by the CP backend's `prepare_batch` on the rank's
    share (nsa.cp_batch.CPMetadata); None outside CP."""

    split_by_slot_owner: bool = False
    metadata: Any = None


# Per-token and per-request rows of the packed host buffer, in upload order.
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "token_to_req")
_REQ_FIELDS = ("req_pool_indices", "seq_lens", "extend_prefix_lens", "extend_seq_lens", "extend_start_loc")


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
    token_to_req: torch.Tensor | None = None  # [T] int64, batch index of each token
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    # Host copy of positions when a request's rows are not consecutive (CP local layouts);
    # None means positions follow extend_prefix_lens + offset.
    positions_cpu: list[int] | None = None

    # Logprobs: per request, the first position whose input logprob is wanted (-1: none).
    return_logprob: bool = False
    logprob_start_lens_cpu: list[int] = field(default_factory=list)
    top_logprobs_nums: list[int] = field(default_factory=list)
    return_all_logits: bool = False  # tests / scoring: logits for every input token

    sampling_info: "SamplingBatchInfo | None" = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    spec: SpecInput | None = None  # the NextN draft's inputs from the target; None for target forwards
    # Rows whose logits (and LAST hidden state) the logits processor returns, one per request,
    # instead of each request's last row (a static-shaped draft extend picks its accepted row).
    logits_row_indices: torch.Tensor | None = None

    # Host copies of the per-token / per-request rows (CPU tensors), for host-side re-layouts (CP)
    # and the KV trace.
    host_rows: dict[str, torch.Tensor] | None = None
    cp: CPBatchInfo = field(default_factory=CPBatchInfo)

    # Set by the model runner.
    req_to_token_pool: Any = None
    token_to_kv_pool: Any = None
    attn_backend: Any = None
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build_decode_rows(cls, input_ids: torch.Tensor, req_pool_indices: torch.Tensor, positions: torch.Tensor,
                          out_cache_loc: torch.Tensor, seq_len_bounds: list[int], **kwargs: Any) -> "ForwardBatch":
        """A decode batch straight from device tensors (one row per token; rows may share a request
        slot): positions are known only on the device, so the host lists hold upper bounds of each
        row's KV length, which size the metadata (never index it). Nothing is uploaded."""
        t = int(input_ids.shape[0])
        ar = torch.arange(t, dtype=torch.int64, device=input_ids.device)
        return cls(
            forward_mode=ForwardMode.DECODE, batch_size=t, input_ids=input_ids, positions=positions,
            req_pool_indices=req_pool_indices, seq_lens=positions + 1, out_cache_loc=out_cache_loc,
            extend_seq_lens=torch.ones_like(ar), extend_prefix_lens=positions, extend_start_loc=ar, token_to_req=ar,
            seq_lens_cpu=list(seq_len_bounds), extend_seq_lens_cpu=[1] * t,
            extend_prefix_lens_cpu=[b - 1 for b in seq_len_bounds], **kwargs)

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
        """Derive positions, seq lens, offsets and the token -> request map on the host from
        per-request prefix / extend lengths, then upload everything in one copy."""
        b, t = len(extend_lens), sum(extend_lens)
        ext = torch.tensor(extend_lens, dtype=torch.int64)
        pre = torch.tensor(prefix_lens, dtype=torch.int64)
        starts = torch.cumsum(ext, 0) - ext
        token_to_req = torch.repeat_interleave(torch.arange(b), ext)
        # position of token i = prefix_len[r] + (i - start[r]), r = token_to_req[i]
        positions = torch.arange(t) + (pre - starts).repeat_interleave(ext)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
        rows = {
            "input_ids": ids.reshape(-1), "positions": positions, "out_cache_loc": out_cache_loc.reshape(-1),
            "token_to_req": token_to_req, "req_pool_indices": torch.tensor(req_pool_indices, dtype=torch.int64),
            "seq_lens": pre + ext, "extend_prefix_lens": pre, "extend_seq_lens": ext, "extend_start_loc": starts,
        }
        for name in _TOKEN_FIELDS:
            if rows[name].numel() != t:
                raise ValueError(f"{name} has {rows[name].numel()} entries for {t} tokens")
        packed = torch.cat([rows[n].to("cpu", torch.int64) for n in _TOKEN_FIELDS + _REQ_FIELDS])
        packed = upload(packed, device)  # the step's one host->device copy
        parts = dict(zip(_TOKEN_FIELDS + _REQ_FIELDS, packed.split([t] * 4 + [b] * 5)))
        return cls(
            forward_mode=forward_mode,
            batch_size=b,
            host_rows=rows,
            seq_lens_cpu=[p + e for p, e in zip(prefix_lens, extend_lens)],
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            **parts,
            **kwargs,
        )
