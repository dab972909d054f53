"""Logits processor: pick the rows whose logits are needed, project with the LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] fp32, at each request's last token
    hidden_states: torch.Tensor | None = None  # captured hidden (EAGLE), per capture mode
    # Input-token logprobs, flattened over requests that asked for them: logprob of input token
    # j+1 given tokens <= j, for j in [logprob_start_len, extend_len - 1) of the extended part.
    input_token_logprobs: torch.Tensor | None = None
    input_top_logprobs_val: list | None = None
    input_top_logprobs_idx: list | None = None
    full_logits: torch.Tensor | None = None  # [T, V] when forward_batch.return_all_logits


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    @staticmethod
    def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
        return forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1

    def forward(self, hidden_states: torch.Tensor, lm_head, forward_batch: ForwardBatch,
                pruned: bool = False) -> LogitsProcessorOutput:
        """`pruned`: hidden_states already holds only each request's last token ([B, H])."""
        last_idx = self.last_token_indices(forward_batch)
        last_hidden = hidden_states if pruned else hidden_states[last_idx]
        next_logits = lm_head.logits(last_hidden).float()
        out = LogitsProcessorOutput(next_token_logits=next_logits)

        mode = forward_batch.capture_hidden_mode
        if mode == CaptureHiddenMode.LAST:
            out.hidden_states = last_hidden
        elif mode == CaptureHiddenMode.FULL:
            out.hidden_states = hidden_states

        if pruned:
            return out
        if forward_batch.return_all_logits:
            out.full_logits = lm_head.logits(hidden_states).float()
        if forward_batch.return_logprob and forward_batch.forward_mode.is_extend():
            self._input_logprobs(hidden_states, lm_head, forward_batch, out)
        return out

    def _input_logprobs(self, hidden_states, lm_head, forward_batch: ForwardBatch, out) -> None:
        rows, targets, counts = [], [], []
        ids = forward_batch.input_ids
        for i in range(forward_batch.batch_size):
            start_len = forward_batch.logprob_start_lens_cpu[i] if forward_batch.logprob_start_lens_cpu else -1
            e = forward_batch.extend_seq_lens_cpu[i]
            s = int(forward_batch.extend_start_loc[i])
            if start_len < 0 or start_len >= e - 1:
                counts.append(0)
                continue
            r = torch.arange(s + start_len, s + e - 1, device=ids.device)
            rows.append(r)
            targets.append(ids[r + 1])
            counts.append(len(r))
        if not rows:
            out.input_token_logprobs = torch.empty(0)
            return
        r, t = torch.cat(rows), torch.cat(targets)
        logprobs = torch.log_softmax(lm_head.logits(hidden_states[r]).float(), dim=-1)
        out.input_token_logprobs = logprobs.gather(1, t[:, None]).squeeze(1)
        nums = forward_batch.top_logprobs_nums or []
        if any(n > 0 for n in nums):
            k = max(nums)
            vals, idx = logprobs.topk(k, dim=-1)
            out.input_top_logprobs_val, out.input_top_logprobs_idx = [], []
            off = 0
            for i, c in enumerate(counts):
                n = nums[i] if i < len(nums) else 0
                out.input_top_logprobs_val.append(vals[off : off + c, :n].tolist())
                out.input_top_logprobs_idx.append(idx[off : off + c, :n].tolist())
                off += c
