"""Prompt logprobs (return_logprob with a logprob_start_len) are projected in row chunks of
INPUT_LOGPROB_CHUNK_ROWS: the same values as one projection of every row, with a transient
bounded by the chunk (an 8192-token prompt chunk of V3.2 took 10.6 GB unchunked, more than the
memory plan leaves free)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.srt.layers import logits_processor
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

VOCAB, HIDDEN = 1000, 16


def _batch(lens: list[int], starts: list[int], top: list[int]) -> ForwardBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=g)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, list(range(len(lens))), [0] * len(lens), lens,
                            torch.arange(sum(lens)), device="cpu")
    fb.return_logprob, fb.logprob_start_lens_cpu, fb.top_logprobs_nums = True, starts, top
    return fb


def _run(fb: ForwardBatch, hidden: torch.Tensor, head: ParallelLMHead):
    return LogitsProcessor(VOCAB)(hidden, head, fb)


def _head() -> ParallelLMHead:
    head = ParallelLMHead(VOCAB, HIDDEN)
    with torch.no_grad():
        head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return head


def test_chunked_prompt_logprobs_equal_one_projection(monkeypatch):
    fb = _batch([40, 7, 30], [0, 3, 12], [0, 5, 2])
    hidden = torch.randn(77, HIDDEN, generator=torch.Generator().manual_seed(2))
    head = _head()
    whole = _run(fb, hidden, head)  # 39 + 3 + 17 = 59 rows in one chunk
    monkeypatch.setattr(logits_processor, "INPUT_LOGPROB_CHUNK_ROWS", 8)  # 8 chunks, the last of 3 rows
    chunked = _run(fb, hidden, head)
    assert whole.input_logprob_counts == chunked.input_logprob_counts == [39, 3, 17]
    for a in ("input_token_logprobs", "input_top_logprobs_val", "input_top_logprobs_idx"):
        x, y = getattr(whole, a), getattr(chunked, a)
        assert x.shape == y.shape and x.shape[0] == 59
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert chunked.input_top_logprobs_val.shape == (59, 5)


def test_prompt_logprob_transient_is_one_chunk(monkeypatch):
    """The regression: without chunks the [rows, vocab] fp32 logits of every row were alive."""
    monkeypatch.setattr(logits_processor, "INPUT_LOGPROB_CHUNK_ROWS", 16)
    fb = _batch([257], [0], [0])
    hidden = torch.randn(257, HIDDEN, generator=torch.Generator().manual_seed(2))
    head = _head()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(fb, hidden, head)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 16 * VOCAB * 4 < 256 * VOCAB * 4
