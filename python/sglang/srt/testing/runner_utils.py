"""Drive a ModelRunner directly (tests, benchmarks): one batched extend, logits of every position."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang.srt.distributed.parallel_state import SINGLE_GROUP

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


def backend_harness(pool, req_to_token_pool, *, num_heads: int = 1, index_heads: int = 0, index_topk: int = 0,
                    context_len: int | None = None, mla_attn_path: str = "auto", device: str = "cpu",
                    deterministic: bool = False, qk_nope_head_dim: int = 0, v_head_dim: int = 0):
    """The parts of a ModelRunner an attention backend reads, for kernel-level tests without a model."""
    is_dsa = bool(index_topk)
    mc = SimpleNamespace(context_len=context_len or req_to_token_pool.max_context_len, num_attention_heads=num_heads,
                         kv_lora_rank=pool.kv_lora_rank, is_dsa=is_dsa, index_topk=index_topk,
                         index_n_heads=index_heads, qk_rope_head_dim=pool.qk_rope_head_dim,
                         qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)
    return SimpleNamespace(model_config=mc, token_to_kv_pool=pool, req_to_token_pool=req_to_token_pool,
                           device=device, tp_group=SINGLE_GROUP, server_args=SimpleNamespace(mla_attn_path=mla_attn_path,
                                                                       enable_deterministic_inference=deterministic))
