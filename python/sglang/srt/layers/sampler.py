"""Sampler: next token per request from [B, V] logits and a SamplingBatchInfo.

Pipeline: apply penalties / grammar mask / logit_bias / min_new_tokens ban (in place, unless the
caller already did) -> custom logit processors (upstream's place for them) -> logprobs -> greedy
argmax, or temperature -> softmax -> joint top-k/top-p/min-p mask -> inverse-CDF draw with one
uniform per row (global RNG, or the row's (seed, step) hash).

Inverse CDF runs in vocabulary order on the masked probabilities, never in sorted order, so a
seeded row's token depends only on its own logits, params and (seed, step): not on whether a
batch mate forced the sort path, nor on its position in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils.common import copies_done_event, to_host_async, upload


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor | None = None  # [B] fp32
    # Per request: (values, ids) of its top-N logprobs, N = top_logprobs_nums[i] (may be 0),
    # on their way to the host (read with .rows() once the step's copies are done).
    top_logprobs: "TopLogprobs | None" = None


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo | None,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
    ) -> SamplerOutput:
        """`logits` [B, V] fp32 is modified in place by the penalties / bias. No sampling_info
        means all greedy."""
        info = sampling_info
        if info is not None and not info.logits_bias_applied:
            info.apply_logits_bias(logits)
        if info is not None and info.has_custom_logit_processor:
            apply_custom_logit_processor(logits, info)

        argmax = logits.argmax(dim=-1)
        if info is None or info.is_all_greedy:
            next_ids = argmax
        else:
            next_ids = _sample(logits, info, argmax)

        out = SamplerOutput(next_token_ids=next_ids.to(torch.int64))
        if return_logprob:
            # Logprobs of the model's distribution after penalties / bias, before temperature and
            # top-k/top-p/min-p (upstream's default): comparable across sampling settings.
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.next_token_logprobs = logprobs.gather(1, out.next_token_ids.view(-1, 1)).view(-1)
            if top_logprobs_nums is not None:
                out.top_logprobs = _top_logprobs(logprobs, top_logprobs_nums)
        if info is not None:
            info.logits_bias_applied = False  # the next step's logits need the bias again
        return out


def apply_custom_logit_processor(logits: torch.Tensor, info: SamplingBatchInfo) -> None:
    """In place: each processor gets the rows of the requests that use it, with their params."""
    if logits.shape[0] != len(info):
        raise ValueError(f"logits have {logits.shape[0]} rows for a batch of {len(info)}")
    params = info.custom_params or [None] * len(info)
    for processor, rows in info.custom_logit_processor.values():
        idx = upload(torch.tensor(rows, dtype=torch.int64), logits.device)
        logits[idx] = processor(logits[idx], [params[i] for i in rows]).to(logits.dtype)


def _sample(logits: torch.Tensor, info: SamplingBatchInfo, argmax: torch.Tensor) -> torch.Tensor:
    bs, vocab = logits.shape
    x = logits.float() / info.temperatures
    # NaN -> never sampled; +inf (or overflow from a tiny temperature) -> the largest finite
    # value, so those tokens share the mass instead of turning the softmax into NaN.
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max,
                         neginf=float("-inf"))
    probs = torch.softmax(x, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no finite logit: handled below

    keep = filter_mask(probs, info)
    if keep is not None:
        probs = probs.masked_fill(~keep, 0.0)

    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = _uniforms(info, bs, logits.device)
    idx = torch.searchsorted(cdf, u.view(-1, 1) * total, right=True).view(-1)
    # searchsorted picks the first cdf strictly above u * total, which always has mass; only
    # when u * total rounds up to total does it run off the end (or onto a zero-mass tail):
    # take the row's most likely kept token then.
    idx = idx.clamp_(max=vocab - 1)
    off_end = probs.gather(1, idx.view(-1, 1)).view(-1) <= 0
    idx = torch.where(off_end, probs.argmax(dim=-1), idx)
    dead = total.view(-1) <= 0  # no finite logit at all: fall back to the logits' argmax
    return torch.where(info.is_greedy | dead, argmax, idx)


def filter_mask(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor | None:
    """[B, V] bool keep-mask (vocab order) of the joint top-k / top-p / min-p filters, all measured
    on the unfiltered `probs`; the top token is always kept. None when no filter is active."""
    keep = None
    if info.need_top_k_sampling or info.need_top_p_sampling:
        # Stable: ties keep the lower token id first, matching torch.argmax.
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
        keep_sorted = ranks < info.top_ks.view(-1, 1)
        if info.need_top_p_sampling:
            # Smallest prefix whose mass reaches top_p: keep a token if the mass before it is < top_p.
            # top_p == 1 rows keep everything explicitly (float cumsum may reach 1 early).
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            top_ps = info.top_ps.view(-1, 1)
            keep_sorted &= (mass_before < top_ps) | (top_ps >= 1.0)
        keep_sorted[:, 0] = True
        keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    if info.need_min_p_sampling:
        max_p = probs.amax(dim=-1, keepdim=True)
        min_keep = probs >= max_p * info.min_ps.view(-1, 1)
        keep = min_keep if keep is None else keep & min_keep
    return keep


def _uniforms(info: SamplingBatchInfo, bs: int, device: torch.device) -> torch.Tensor:
    if info.seeded_mask is None:
        return torch.rand(bs, device=device)
    seeded_u = info.seeded_uniforms.to(device)
    if all(s is not None for s in info.sampling_seeds):  # host-side check: no device sync
        return seeded_u  # leave the global RNG untouched
    return torch.where(info.seeded_mask.to(device), seeded_u, torch.rand(bs, device=device))


class TopLogprobs:
    """A step's top-N logprobs per request: the [B, k] values / ids queued to the host with the
    step's other outputs (no sync in the sampler); `rows()` reads them once those copies are done."""

    def __init__(self, vals: torch.Tensor, ids: torch.Tensor, nums: list[int]) -> None:
        self.nums = nums
        self._vals, self._ids = to_host_async(vals), to_host_async(ids)
        self._done = copies_done_event(vals)
        self._rows: list[tuple[list[float], list[int]]] | None = None

    def rows(self) -> list[tuple[list[float], list[int]]]:
        if self._rows is None:
            if self._done is not None:
                self._done.synchronize()
            v, i = self._vals.tolist(), self._ids.tolist()
            self._rows = [(v[r][:n], i[r][:n]) for r, n in enumerate(self.nums)]
        return self._rows


def _top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> TopLogprobs:
    k = min(max(nums, default=0), logprobs.shape[-1])
    vals, ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    return TopLogprobs(vals, ids, nums)
