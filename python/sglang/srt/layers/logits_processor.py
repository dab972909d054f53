"""Logits processor: pick the rows whose logits are needed, project with the LM head.

Under context parallel a forward computes this rank's rows of the batch only; a target model's
logits are of the scheduler's batch, so the rows they need are gathered back first -- by the CP
metadata that laid them out (`forward_batch.cp.metadata.logits_output`), not by the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch


# Input-logprob rows projected at once: their [rows, vocab] logits (bf16, fp32, log-softmax) are the
# transient, 1.3 GB at V3.2's 129280 vocab; unchunked, an 8192-token prompt chunk asking for prompt
# logprobs took 10.6 GB beside a KV pool planned to leave ~4 (model_executor/memory_plan.py).
INPUT_LOGPROB_CHUNK_ROWS = 1024


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] fp32, at each request's last token
    hidden_states: torch.Tensor | None = None  # captured hidden (EAGLE), per capture mode
    # Input-token logprobs, flattened over requests that asked for them: logprob of input token
    # j+1 given tokens <= j, for j in [logprob_start_len, extend_len - 1) of the extended part.
    input_token_logprobs: torch.Tensor | None = None
    input_logprob_counts: list[int] | None = None  # rows per request in input_token_logprobs
    input_top_logprobs_val: torch.Tensor | None = None  # [rows, max top_logprobs_num]
    input_top_logprobs_idx: torch.Tensor | None = None
    full_logits: torch.Tensor | None = None  # [T, V] when forward_batch.return_all_logits
    # With full hidden capture: the top-k the last layer passes on to the NextN draft layer
    # (IndexCache sharing on; else None), per row as computed.
    topk_indices: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        """Under CP the logits are the scheduler's batch's on every rank (CPMetadata.logits_output),
        the NextN draft's too: each rank keeps the same next draft per request."""
        super().__init__()
        self.vocab_size = vocab_size

    @staticmethod
    def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
        if forward_batch.logits_row_indices is not None:
            return forward_batch.logits_row_indices
        return forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1

    def forward(self, hidden_states: torch.Tensor, lm_head, forward_batch: ForwardBatch,
                topk_indices: torch.Tensor | None = None) -> LogitsProcessorOutput:
        """The model's output: logits (+ hidden states per capture mode; with full capture, the
        `topk_indices` the last layer passes on to the NextN draft layer)."""
        cp = forward_batch.cp.metadata
        if cp is not None:
            return cp.logits_output(self, hidden_states, topk_indices, lm_head, forward_batch)
        out = self.project(hidden_states, lm_head, forward_batch)
        if forward_batch.capture_hidden_mode in (CaptureHiddenMode.FULL, CaptureHiddenMode.FULL_LOCAL):
            out.topk_indices = topk_indices
        return out

    def project(self, hidden_states: torch.Tensor, lm_head, forward_batch: ForwardBatch,
                pruned: bool = False) -> LogitsProcessorOutput:
        """`pruned`: hidden_states already holds only each request's last token ([B, H])."""
        last_idx = self.last_token_indices(forward_batch)
        last_hidden = hidden_states if pruned else hidden_states[last_idx]
        next_logits = lm_head.logits(last_hidden).float()
        out = LogitsProcessorOutput(next_token_logits=next_logits)

        mode = forward_batch.capture_hidden_mode
        if mode == CaptureHiddenMode.LAST:
            out.hidden_states = last_hidden
        elif mode in (CaptureHiddenMode.FULL, CaptureHiddenMode.FULL_LOCAL):
            out.hidden_states = hidden_states

        if pruned:
            return out
        if forward_batch.return_all_logits:
            out.full_logits = lm_head.logits(hidden_states).float()
        if forward_batch.return_logprob and forward_batch.forward_mode.is_extend():
            self._input_logprobs(hidden_states, lm_head, forward_batch, out)
        return out

    def _input_logprobs(self, hidden_states, lm_head, forward_batch: ForwardBatch, out) -> None:
        # Rows are chosen on the host (CPU lists), then gathered in one indexing op.
        rows, counts, s = [], [], 0
        for i, e in enumerate(forward_batch.extend_seq_lens_cpu):
            start_len = forward_batch.logprob_start_lens_cpu[i] if forward_batch.logprob_start_lens_cpu else -1
            n = max(e - 1 - start_len, 0) if start_len >= 0 else 0
            rows.extend(range(s + start_len, s + start_len + n))
            counts.append(n)
            s += e
        if not rows:
            out.input_token_logprobs = torch.empty(0)
            return
        ids = forward_batch.input_ids
        r = torch.tensor(rows, device=ids.device)
        t = ids[r + 1]
        nums = forward_batch.top_logprobs_nums or []
        k = max(nums) if any(n > 0 for n in nums) else 0
        token_lp, top_val, top_idx = [], [], []
        for i in range(0, len(rows), INPUT_LOGPROB_CHUNK_ROWS):  # row-wise: values as unchunked (up to the GEMM's kernel choice for M rows)
            j = slice(i, i + INPUT_LOGPROB_CHUNK_ROWS)
            logprobs = torch.log_softmax(lm_head.logits(hidden_states[r[j]]).float(), dim=-1)
            token_lp.append(logprobs.gather(1, t[j, None]).squeeze(1))
            if k:
                v, ix = logprobs.topk(k, dim=-1)
                top_val.append(v)
                top_idx.append(ix)
            del logprobs
        out.input_token_logprobs = torch.cat(token_lp)
        out.input_logprob_counts = counts
        if k:
            # Kept on the device; the scheduler copies them once with the step's results.
            out.input_top_logprobs_val, out.input_top_logprobs_idx = torch.cat(top_val), torch.cat(top_idx)
