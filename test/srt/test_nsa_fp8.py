"""The FP8 index-K default, through the shipped code.

1. The Indexer module's forward (prefill, then a decode step) over a real NSA pool, on inputs
   built so the exact top-k has a margin just above the worst-case e4m3 error: then any correct
   FP8 path (Hadamard-rotated q and k, both quantised, per-128 scales) must select exactly the
   exact top-k. The keys are aligned with a direction in the Hadamard matrix's -1 eigenspace, so
   scoring unrotated q against rotated k (or the reverse) ranks them last and the test fails.
2. End to end on the tiny DSA models, FP8 vs exact index K: agreement is reported, with a floor
   (random tiny models have flat index scores, so FP8 swaps tied keys and the swaps cascade).
"""

import math

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.layers.attention.attention_registry import create_attn_backend
from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.testing.runner_utils import backend_harness

D, H, R, TOPK, L = 64, 4, 16, 16, 96  # index head dim, index heads, rope dims, index_topk, prompt length
Q_NORM, K_NORM = 2.0, math.sqrt(D)  # |q_h|; LayerNorm output has unit mean square, so |k| = sqrt(D)
# e4m3 (3 mantissa bits, round to nearest): |err| <= |x| / 16 in the normal range and <= 2^-10 * s
# below it, s = block amax / 448 <= |x|_2 / 448; so |err|_2 <= EPS * |x|_2 for a whole vector.
EPS = 2**-4 + math.sqrt(D) * 2**-10 / 448
# q.k with both factors quantised is off by at most (2 EPS + EPS^2) |q| |k| (Hadamard rotation keeps
# norms); ReLU is 1-Lipschitz. In units of cos(q, k): the worst-case score error.
COS_ERR = 2 * EPS + EPS**2
MEASURED_TF_AGREEMENT_FLOOR = 0.4  # teacher-forced argmax agreement end to end; measured ~0.6


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _directions(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u: unit, zero on the rope dims, zero-sum (LayerNorm leaves it alone), H u = -u.
    noise: n unit vectors with the same constraints but orthogonal to u."""
    constraints = torch.cat([torch.eye(D) + _hadamard(D), torch.eye(D)[:R], torch.ones(1, D)])
    _, s, vh = torch.linalg.svd(constraints)
    null = vh[(s > 1e-5).sum():]  # rows spanning the solutions
    u = null[0] / null[0].norm()
    free = torch.cat([torch.eye(D)[:R], torch.ones(1, D) / math.sqrt(D), u[None]])  # to project out
    basis = torch.linalg.qr(free.T).Q  # orthonormal columns
    raw = torch.randn(n, D, generator=g)
    noise = raw - (raw @ basis) @ basis.T
    return u, noise / noise.norm(dim=-1, keepdim=True)


def _indexer() -> Indexer:
    rope = RotaryEmbedding(R, 256, {"rope_type": "default", "rope_theta": 10000.0}, interleaved=False)
    idx = Indexer(D + 1, H * D, H, D, R, TOPK, 0, rope, dtype=torch.float32)
    wk = torch.zeros(D, D + 1)
    wk[:, :D] = torch.eye(D)  # k = k_norm(x[:D])
    gamma = torch.ones(D)
    gamma[:R] = 0  # rope part of k is zero, so positions do not matter
    w_proj = torch.zeros(H, D + 1)
    w_proj[:, D] = 1.0  # every head weighs 1 (x[D] == 1)
    idx.load_state_dict({"wq_b.weight": torch.eye(H * D), "wk.weight": wk, "k_norm.weight": gamma,
                         "k_norm.bias": torch.zeros(D), "weights_proj.weight": w_proj}, strict=True)
    return idx


def _inputs(seed: int):
    """x (keys), q_lora (queries) for L + 1 tokens and the cosines cos(q, k_j)."""
    g = torch.Generator().manual_seed(seed)
    u, noise = _directions(g, L + 1)
    strong = torch.randperm(L // 2, generator=g)[:TOPK]  # all within the first half
    lo_strong = 0.55
    hi_weak = lo_strong - 2 * COS_ERR - 0.02  # the margin: just above twice the worst-case error
    cos = torch.rand(L + 1, generator=g) * (hi_weak + 0.9) - 0.9  # weak keys in [-0.9, hi_weak]
    cos[strong] = lo_strong + torch.rand(TOPK, generator=g) * 0.4
    k = K_NORM * (cos[:, None] * u + torch.sqrt(1 - cos[:, None] ** 2) * noise)
    x = torch.cat([k, torch.ones(L + 1, 1)], dim=1)
    q_lora = (Q_NORM * u).repeat(L + 1, H)
    return x, q_lora, set(strong.tolist())


@torch.inference_mode()  # as the model runner runs it
def _run(index_k_dtype: str, page_size: int, x, q_lora, backend_name: str = "torch"):
    """Prefill L tokens, then decode one, through Indexer.forward; returns both top-k outputs."""
    idx = _indexer()
    pool = NSATokenToKVPool(512, page_size, torch.float32, 16, 8, 1, D, index_k_dtype)
    r2t, alloc = ReqToTokenPool(2, 512), PagedTokenToKVPoolAllocator(512, page_size)
    backend = create_attn_backend(backend_name, backend_harness(pool, r2t, index_heads=H, index_topk=TOPK))
    slot = r2t.alloc(1)[0]
    loc = alloc.alloc_extend([0], [L + 1], [-1])
    r2t.write(slot, 0, loc)
    outs = []
    for mode, start, n in ((ForwardMode.EXTEND, 0, L), (ForwardMode.DECODE, L, 1)):
        fb = ForwardBatch.build(mode, [0] * n, [slot], [start], [n], loc[start : start + n])
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, pool, backend
        backend.init_forward_metadata(fb)
        outs.append(idx(x[start : start + n], q_lora[start : start + n], fb.positions, fb))
    return outs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_indexer_keeps_every_top_k_with_an_e4m3_margin(page_size, seed, backend):
    assert COS_ERR < 0.13  # the margin the inputs are built with stays meaningful
    x, q_lora, strong = _inputs(seed)
    checked_rows = range(max(strong), L)  # every strong key is visible (and L > TOPK: scored)
    for mode in ("float32", "fp8_e4m3"):
        prefill, decode = _run(mode, page_size, x, q_lora, backend)
        assert prefill.shape == (L, TOPK) and decode.shape == (1, TOPK)
        for t in checked_rows:
            assert set(prefill[t].tolist()) == strong, (mode, t)
        assert set(decode[0].tolist()) == strong, mode


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-moe-dsa"])
def test_fp8_end_to_end_agreement_reported(name, builtin_path, record_property):
    prompts = [torch.randint(5, 1000, (n,), generator=torch.Generator().manual_seed(1)).tolist()
               for n in (60, 100, 150, 200)]
    sp = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    runs, logits = {}, {}
    for mode in ("float32", "fp8_e4m3"):
        engine = Engine(model_path=builtin_path(name), dtype="float32", device="cpu", max_total_tokens=8192,
                        nsa_index_k_dtype=mode)
        runs[mode] = engine.generate(input_ids=prompts, sampling_params=sp)
        # input_top_logprobs: per prompt position, [(logprob, token_id, None)]; position 0 has none.
        logits[mode] = [torch.tensor([row[0][1] for row in r["meta_info"]["input_top_logprobs"][1:]])
                        for r in engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1},
                                                 return_logprob=True, logprob_start_len=0, top_logprobs_num=1)]
    greedy = [sum(a == b for a, b in zip(x["output_ids"], y["output_ids"])) / 32
              for x, y in zip(runs["float32"], runs["fp8_e4m3"])]
    # Teacher-forced: does each prompt position's argmax agree (no cascade through outputs)?
    tf = torch.cat([(a == b).float() for a, b in zip(logits["float32"], logits["fp8_e4m3"])])
    report = {"greedy_token_agreement": sum(greedy) / len(greedy), "teacher_forced_argmax_agreement": tf.mean().item()}
    print(f"{name}: FP8 vs exact index K: {report}")
    for k, v in report.items():
        record_property(k, v)
    assert report["teacher_forced_argmax_agreement"] >= MEASURED_TF_AGREEMENT_FLOOR
