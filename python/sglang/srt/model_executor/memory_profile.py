"""A profile forward of the largest step, before the KV pool exists (as vLLM's profile_run): the
GPU half of the memory plan (model_executor/memory_plan.py).

The step is `tokens` new tokens whose rows end at the context length (one request, or several of
at most the context length each), so the index scores are as wide as they can get. Their KV goes
into a temporary pool of just those tokens; the prefix positions map to slot 0 (the padding
page), whose contents do not matter for memory. Nothing it builds outlives the call."""

from __future__ import annotations

import gc
from typing import Callable

import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def profile_requests(tokens: int, context_len: int) -> list[tuple[int, int]]:
    """(prefix, extend) per request: chunks of the context length, the last one ending at it."""
    out = []
    left = tokens
    while left > 0:
        n = min(left, context_len)
        out.append((context_len - n, n))
        left -= n
    return out


@torch.inference_mode()
def run_profile_forward(runner, tokens: int, context_len: int, seed: int = 0):
    """One extend forward of `tokens` tokens through `runner.model` on temporary pools; returns its
    LogitsProcessorOutput. `runner` is a ModelRunner whose model is loaded and whose pools are
    not built yet (it gets them only for the call)."""
    from sglang.srt.layers.attention.attention_registry import create_hybrid_backend

    sa, page = runner.server_args, runner.page_size
    reqs = profile_requests(tokens, context_len)
    size = -(-tokens // page) * page
    saved = (getattr(runner, "req_to_token_pool", None), getattr(runner, "token_to_kv_pool", None))
    try:
        runner.req_to_token_pool = ReqToTokenPool(len(reqs), context_len + 1, runner.device)
        runner.token_to_kv_pool = runner._make_kv_pool(size)
        backend = create_hybrid_backend(sa.nsa_prefill_backend, sa.nsa_decode_backend, runner)
        locs = torch.arange(page, page + tokens, dtype=torch.int64)
        start = 0
        for i, (prefix, n) in enumerate(reqs):
            if prefix:
                runner.req_to_token_pool.write(i, 0, torch.zeros(prefix, dtype=torch.int64))
            runner.req_to_token_pool.write(i, prefix, locs[start : start + n])
            start += n
        vocab = runner.model_config.vocab_size
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, list(range(len(reqs))), [p for p, _ in reqs],
                                [n for _, n in reqs], locs, device=runner.device)
        runner.req_to_token_pool.flush_writes()
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = (runner.req_to_token_pool,
                                                                     runner.token_to_kv_pool, backend)
        backend.init_forward_metadata(fb)
        return runner.model.forward(fb.input_ids, fb.positions, fb)
    finally:
        runner.req_to_token_pool, runner.token_to_kv_pool = saved


def measure_peak_bytes(fn: Callable[[], object]) -> int:
    """Device bytes `fn` needs beyond what is allocated before it: the caching allocator's peak,
    plus what the device lost outside it meanwhile (workspaces, kernel modules)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    free0, _ = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    free1, _ = torch.cuda.mem_get_info()
    outside = max(0, (free0 - free1) - (torch.cuda.memory_reserved() - reserved0))
    del out
    gc.collect()
    torch.cuda.empty_cache()
    return peak + outside


def profile_step_peak(runner, tokens: int, context_len: int) -> int:
    """Peak bytes of the profile forward on the GPU, less its temporary KV pool (the real pool is
    planned apart)."""
    pool = -(-tokens // runner.page_size) * runner.page_size * runner._bytes_per_token()
    return max(0, measure_peak_bytes(lambda: run_profile_forward(runner, tokens, context_len)) - pool)
