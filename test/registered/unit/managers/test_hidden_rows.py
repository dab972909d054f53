"""return_hidden_states bookkeeping (scheduler_output_processor): which rows are copied to the
host, and how they become upstream's meta_info shape, over chunks and a retraction. CPU, fast."""

from __future__ import annotations

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_output_processor import _start_hidden_copy, _take_hidden_rows
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams


def _step(reqs, prefix_lens, extend_lens, mode=ForwardMode.EXTEND):
    """One forward whose hidden state at (request i, position p) is the row [i, p]."""
    batch = ScheduleBatch(reqs, mode)
    batch.prefix_lens, batch.extend_lens = prefix_lens, extend_lens
    hs = torch.tensor([[float(i), float(p)] for i, (pl, e) in enumerate(zip(prefix_lens, extend_lens))
                       for p in range(pl, pl + e)])
    host, spans = _start_hidden_copy(batch, hs)
    for req, span in zip(reqs, spans):
        if span is not None:
            _take_hidden_rows(req, span[0], host[span[1]:span[2]].tolist())


def _req(n_prompt: int, hidden: bool = True) -> Req:
    return Req("r", list(range(n_prompt)), SamplingParams(max_new_tokens=8), return_hidden_states=hidden)


def test_chunks_then_decode_then_retraction():
    a, b = _req(5), _req(3, hidden=False)
    _step([a, b], [0, 0], [3, 3])  # a's first chunk; b does not ask
    assert a.pending_hidden == [] and a.hidden_prompt_rows == [[0.0, 0.0], [0.0, 1.0], [0.0, 2.0]]
    assert b.pending_hidden == [] and b.hidden_emitted == 0
    _step([a], [3], [2])  # the prompt completes: one block of 5 rows
    assert a.pending_hidden == [[[0.0, p] for p in (0.0, 1.0, 2.0)] + [[0.0, 3.0], [0.0, 4.0]]]
    a.pending_hidden = []
    a.output_ids = [7, 8]
    _step([a], [5], [1], ForwardMode.DECODE)  # position 5 = the first output fed back
    assert a.pending_hidden == [[0.0, 5.0]]
    a.pending_hidden = []
    # retracted, then re-prefilled from scratch over prompt + outputs: only position 6 is new
    _step([a], [0], [7])
    assert a.pending_hidden == [[0.0, 6.0]] and a.hidden_emitted == 7


def test_not_asked_means_no_copy():
    batch = ScheduleBatch([_req(4, hidden=False)], ForwardMode.EXTEND)
    batch.prefix_lens, batch.extend_lens = [0], [4]
    host, spans = _start_hidden_copy(batch, torch.zeros(4, 2))
    assert spans == [None] and host.shape == (0, 2)


def test_hidden_requests_bypass_the_prefix_cache():
    assert _req(10).max_prefix_len() == 0 and _req(10, hidden=False).max_prefix_len() == 9
