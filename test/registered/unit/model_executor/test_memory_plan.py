"""The device memory plan (model_executor/memory_plan.py) on CPU: its arithmetic with the real
DeepSeek-V3.2 config (transformers' DeepseekV32Config defaults, layer 0 dense and the rest MoE, as
the e2e benchmark builds it) on an 80 GB H100, the start-up errors that name the flags, and the
GPU code path of ModelRunner.plan_device_memory with the device's numbers faked.

Card: an H100 80GB reports 85,031,714,816 bytes (79.19 GiB) total; a CUDA context takes ~0.5 GiB
before the weights. Weights: the meta-device bytes of the model (what loading allocates) plus the
absorbed-MLA copies of kv_b_proj (w_kc, w_vc) that post_load_weights makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor import memory_plan as mp
from sglang.srt.model_executor.memory_plan import (
    GiB,
    GraphNeeds,
    MemoryPlanError,
    ModelShape,
    cuda_graph_bytes,
    estimate_forward_bytes,
    max_step_tokens,
    plan_memory,
)
from sglang.srt.model_loader.loader import model_weight_bytes
from sglang.srt.server_args import ServerArgs

H100_TOTAL = 85_031_714_816
CUDA_CONTEXT = GiB // 2
PAGE = 64
V32_CTX = 163840  # max_position_embeddings of DeepseekV32Config


def _v32_config(tmp_path, layers: int, experts: int = 256) -> ModelConfig:
    cfg = transformers.DeepseekV32Config(num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts)
    cfg.architectures = ["DeepseekV32ForCausalLM"]
    d = tmp_path / f"v32-{layers}l-{experts}e"
    cfg.save_pretrained(d)
    return ModelConfig(str(d), "bfloat16")


def _weights(mc: ModelConfig) -> int:
    kv_b = mc.num_attention_heads * (mc.hf_config.qk_nope_head_dim + mc.hf_config.v_head_dim) * mc.kv_lora_rank
    return model_weight_bytes(mc) + mc.num_hidden_layers * kv_b * 2  # + w_kc / w_vc (bf16)


def _server_args(**kw) -> ServerArgs:
    return ServerArgs(model_path="unused", **kw)


def _plan(mc: ModelConfig, sa: ServerArgs, total: int = H100_TOTAL) -> mp.MemoryPlan:
    """What ModelRunner.plan_device_memory computes from these numbers (its arithmetic path)."""
    shape = ModelShape.from_model_config(mc)
    step = max_step_tokens(sa, mc.context_len)
    running = sa.max_running_requests or mp.DEFAULT_MAX_RUNNING_REQUESTS
    act = estimate_forward_bytes(shape, step, mc.context_len, min(running, step), score_budget=2**31).peak
    graphs = cuda_graph_bytes(shape, mc.context_len, min(sa.cuda_graph_max_bs, running))
    weights = _weights(mc)
    per_token = mc.num_hidden_layers * ((mc.kv_lora_rank + mc.qk_rope_head_dim) * 2 + 132)  # bf16 MLA + FP8 index K
    return plan_memory(total_bytes=total, free_bytes=total - CUDA_CONTEXT - weights, weight_bytes=weights,
                       kv_bytes_per_token=per_token, activation_bytes=act, graph_bytes=graphs,
                       req_to_token_bytes=(running + 2) * (mc.context_len + 1) * 4, step_tokens=step,
                       page_size=PAGE, mem_fraction_static=sa.mem_fraction_static,
                       max_total_tokens=sa.max_total_tokens)


# -- real V3.2 shapes on an 80 GB card --------------------------------------------------------------
@pytest.mark.parametrize("layers, min_weights_gib", [(2, 25), (3, 46)])
def test_v32_fits_an_80gb_card_with_the_reserve(tmp_path, layers, min_weights_gib):
    mc = _v32_config(tmp_path, layers)
    plan = _plan(mc, _server_args())
    assert plan.weights > min_weights_gib * GiB  # the 28 GB / 51 GB: all 256 experts
    assert plan.step_tokens == 8192  # --chunked-prefill-size: a 32K prompt runs as 4 such steps
    assert plan.kv_tokens % PAGE == 0 and plan.kv_tokens >= 32768 * 8  # room for many 32K prompts
    # the reserve is left free after the KV pool and covers every phase of the largest step, of
    # its 32K-prompt chunks (shorter rows) and of an eager decode of the most running requests
    assert plan.free_after_kv >= plan.reserve
    shape = ModelShape.from_model_config(mc)
    for tokens, width, decode in [(8192, V32_CTX, False), (8192, 32768, False), (256, V32_CTX, True)]:
        need = estimate_forward_bytes(shape, tokens, width, min(256, tokens), decode=decode, score_budget=2**31)
        assert need.peak <= plan.activations
    assert plan.activations + plan.weights + plan.kv_bytes + plan.cuda_graphs < H100_TOTAL - CUDA_CONTEXT


def test_v32_reserve_is_the_size_the_config_implies(tmp_path):
    """Pins the arithmetic: a 8192-token step of V3.2 peaks in the indexer (the score chunk of the
    2 GiB budget over 163840 keys, on top of the MLA projections) at 3.5-4.5 GiB; the absorbed MLA
    (q_lat + o_lat: 2 x 128 heads x 512 x bf16 = 256 KB a token) is the next phase."""
    shape = ModelShape.from_model_config(_v32_config(tmp_path, 2))
    est = estimate_forward_bytes(shape, 8192, V32_CTX, 256, score_budget=2**31)
    assert 3.5 * GiB < est.peak < 4.5 * GiB and est.peak_phase == "attention: indexer"
    assert est.phases["attention: MLA"] > 2 * 8192 * 128 * 512 * 2
    # no index scores when every row is within index_topk; linear in tokens otherwise
    short = estimate_forward_bytes(shape, 2048, 2048, 1, score_budget=2**31)
    assert short.phases["attention: indexer"] < short.phases["attention: MLA"]
    # prompt logprobs of a whole step: one 1024-row chunk of [rows, 129280] logits, not 8192 rows
    assert 1.2 * GiB < est.phases["input logprobs"] < 2 * GiB
    big = estimate_forward_bytes(shape, 32768, 32768, 256, score_budget=2**31).phases["attention: MLA"]
    assert 3.9 < big / est.phases["attention: MLA"] < 4.1


@pytest.mark.parametrize("layers, chunk", [(5, 8192), (4, 32768)])
def test_weights_and_reserve_that_cannot_fit_name_the_flags(tmp_path, layers, chunk):
    """5 layers: 91 GB of weights alone; 4 layers (69 GiB) fit with the default 8192-token steps
    but not with 32768-token ones."""
    mc = _v32_config(tmp_path, layers)
    with pytest.raises(MemoryPlanError) as e:
        _plan(mc, _server_args(chunked_prefill_size=chunk))
    msg = str(e.value)
    for flag in ("--chunked-prefill-size", "--max-prefill-tokens", "--cuda-graph-max-bs", "num_hidden_layers",
                 "n_routed_experts"):
        assert flag in msg
    assert "leave no room for a KV cache" in msg and f"a {chunk}-token step" in msg
    if layers == 4:
        assert _plan(mc, _server_args()).kv_tokens > 0


def test_unchunked_prefill_of_the_whole_context_cannot_fit(tmp_path):
    """Without chunking a prompt of the whole 163840-token context is one step: its activations
    alone exceed the card, and the error says which flags shrink the step."""
    sa = _server_args(chunked_prefill_size=-1)
    mc = _v32_config(tmp_path, 2)
    assert max_step_tokens(sa, V32_CTX) == 16383 + V32_CTX
    with pytest.raises(MemoryPlanError, match="--chunked-prefill-size"):
        _plan(mc, sa)


def test_explicit_mem_fraction_static_must_leave_the_reserve(tmp_path):
    mc = _v32_config(tmp_path, 2)
    auto = _plan(mc, _server_args())
    ok = _plan(mc, _server_args(mem_fraction_static=0.85))
    assert ok.weights + ok.kv_bytes <= 0.85 * H100_TOTAL and ok.kv_tokens < auto.kv_tokens
    with pytest.raises(MemoryPlanError) as e:
        _plan(mc, _server_args(mem_fraction_static=0.97))
    msg = str(e.value)
    assert "--mem-fraction-static 0.97 leaves" in msg
    best = float(msg.split("use --mem-fraction-static ")[1].split()[0])
    assert _plan(mc, _server_args(mem_fraction_static=best)).kv_tokens > 0  # the value it names works


def test_max_total_tokens_is_checked_against_the_card(tmp_path):
    mc = _v32_config(tmp_path, 3)
    auto = _plan(mc, _server_args())
    assert _plan(mc, _server_args(max_total_tokens=4096)).kv_tokens == 4096
    with pytest.raises(MemoryPlanError, match="--max-total-tokens"):
        _plan(mc, _server_args(max_total_tokens=auto.kv_tokens + 10 * PAGE))


def test_max_step_tokens():
    assert max_step_tokens(_server_args(), 4096) == 8192
    assert max_step_tokens(_server_args(chunked_prefill_size=2048, enable_mixed_chunk=True,
                                        max_running_requests=32), 4096) == 2048 + 32
    off = _server_args(chunked_prefill_size=-1, max_prefill_tokens=1000)
    assert max_step_tokens(off, 4096) == 999 + 4096
    assert max_step_tokens(dataclasses.replace(off, max_total_tokens=2048), 4096) == 999 + 2048


def test_graph_pool_keeps_every_buckets_outputs(tmp_path):
    shape = ModelShape.from_model_config(_v32_config(tmp_path, 2))
    one = cuda_graph_bytes(shape, V32_CTX, 1)
    full = cuda_graph_bytes(shape, V32_CTX, 160)
    logits = sum(mp.get_batch_sizes_to_capture(160)) * shape.vocab * 4
    assert full - one > logits  # outputs of all 21 buckets ([bs, 129280] fp32 each) stay alive
    verify = cuda_graph_bytes(shape, V32_CTX, 16, (GraphNeeds(batch_scale=4, hidden_out=True),))
    assert verify > cuda_graph_bytes(shape, V32_CTX, 64)  # 64 rows + their hidden outputs
    assert cuda_graph_bytes(shape, V32_CTX, 0) == 0


def test_prefill_scores_charge_the_topk_prefilter_scratch(tmp_path):
    """Prefill score rows of >= 16K keys take the top-k prefilter (H100: 1.54x at 32K); its scratch
    (2k fp32 + 2k int32 per row, topk_plan.scratch_bytes_per_row) is in the plan's indexer phase,
    as the backend's chunking charges it. Narrower rows and decode allocate none."""
    from sgl_kernel.topk_plan import PREFILTER_MIN_WIDTH, prefilter_for, scratch_bytes_per_row

    assert not prefilter_for(PREFILTER_MIN_WIDTH - 1, 2048) and prefilter_for(PREFILTER_MIN_WIDTH, 2048)
    assert not prefilter_for(PREFILTER_MIN_WIDTH, PREFILTER_MIN_WIDTH // 2)  # rows of <= 2k keys: plain path
    assert scratch_bytes_per_row(32768, 2048) == 2 * 2048 * 8 and scratch_bytes_per_row(4096, 2048) == 0
    shape = ModelShape.from_model_config(_v32_config(tmp_path, 2))
    t, wide, narrow = 4096, PREFILTER_MIN_WIDTH, PREFILTER_MIN_WIDTH - 64

    def indexer(width: int, **kw) -> int:
        return estimate_forward_bytes(shape, t, width, 1, **kw).phases["attention: indexer"]

    assert indexer(wide) - indexer(narrow) == t * 4 * (wide - narrow) + t * scratch_bytes_per_row(wide, 2048)
    assert indexer(wide, decode=True) - indexer(narrow, decode=True) == t * 4 * (wide - narrow)
