"""Drive a ModelRunner directly (tests, benchmarks): one batched extend, logits of every position."""

from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def prefill_all_logits(model_runner, prompts: list[list[int]], **forward_batch_kwargs) -> list[torch.Tensor]:
    """Prefill every prompt in one extend batch; returns per-prompt [len, V] fp32 logits on CPU and
    frees the KV slots and request slots it took."""
    mr = model_runner
    lens = [len(p) for p in prompts]
    slots = mr.req_to_token_pool.alloc(len(prompts))
    loc = mr.token_to_kv_pool_allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    off = 0
    for s, n in zip(slots, lens):
        mr.req_to_token_pool.write(s, 0, loc[off : off + n])
        off += n
    fb = ForwardBatch.build(ForwardMode.EXTEND, sum(prompts, []), slots, [0] * len(lens), lens, loc,
                            device=mr.device, return_all_logits=True, **forward_batch_kwargs)
    logits = mr.forward(fb).full_logits.cpu()
    mr.token_to_kv_pool_allocator.free(loc)
    mr.req_to_token_pool.free(slots)
    return list(logits.split(lens))
