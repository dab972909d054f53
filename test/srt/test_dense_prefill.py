"""Dense MHA for short DSA prefills (issue 31 item 4): a request whose whole KV is at most
index_topk keys (the indexer would select them all) extends through non-absorbed MHA. On vs off
(SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0), on the torch and the Triton backends: the
same greedy tokens, logits within fp32 rounding, both equal to transformers'; batches mixing
dense and sparse requests, and chunked prefill (a dense chunk over a cached prefix)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.layers.attention.nsa import triton_backend
from sglang.srt.layers.attention.nsa.nsa_backend import NativeSparseAttnBackend
from sglang.srt.layers.attention.nsa.utils import DENSE_PREFILL_ENV, DensePrefillRule, dense_prefill_rule
from sglang.srt.testing.reference import hf_prefill_logits, load_hf_reference
from sglang.srt.testing.runner_utils import prefill_all_logits

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
LOGIT_ATOL = 1e-4  # fp32 weights, float32 index K: as test_model_parity
# index_topk 256: prompts of 150-250 tokens are dense (tiny dims: dense pays off above ~128 keys),
# 300 exceeds index_topk (sparse), 40 is too short for the decompression to pay (sparse)
PROMPT_LENS = {"torch": [200, 300, 150, 40], "triton": [150, 40]}  # Triton's interpreter is slow: a short mix
DENSE_ABOVE = 128  # with these dims and no prefix, dense from ~128 keys up to index_topk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, builtin_path) -> str:
    src = builtin_path("tiny-deepseek-v32")
    dst = str(tmp_path_factory.mktemp("dense") / "m")
    shutil.copytree(src, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["index_topk"] = 256  # weights do not depend on it
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dst


def _prompts(lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lens]


def _engine(path: str, backend: str, **kw) -> Engine:
    return Engine(model_path=path, dtype="float32", device=DEVICE, max_total_tokens=4096, nsa_index_k_dtype="float32",
                  random_seed=0, disable_cuda_graph=True, nsa_prefill_backend=backend, nsa_decode_backend=backend,
                  **kw)


def _count_dense(monkeypatch, backend: str) -> list[int]:
    """Counts the rows each forward sends through the dense path (so the test fails if it never runs)."""
    rows: list[int] = []
    if backend == "triton":
        orig = triton_backend.TritonNSABackend._dense_mha

        def counted(q_nope, q_rope, layer, pool, fb, dm, out):
            rows.append(int(dm.q_blocks[:, 1].sum()))
            return orig(q_nope, q_rope, layer, pool, fb, dm, out)

        monkeypatch.setattr(triton_backend.TritonNSABackend, "_dense_mha", staticmethod(counted))
    else:
        orig = NativeSparseAttnBackend._extend_per_request

        def counted(self, pool, layer, q_nope, q_rope, fb, md, topk, out, reqs):
            rows.append(sum(e for e, d, r in zip(md.extend_lens, md.dense, reqs) if d and r))
            return orig(self, pool, layer, q_nope, q_rope, fb, md, topk, out, reqs)

        monkeypatch.setattr(NativeSparseAttnBackend, "_extend_per_request", counted)
    return rows


def _greedy(engine: Engine, prompts) -> list[tuple]:
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 4,
                                                               "ignore_eos": True}, return_logprob=True)
    return [(o["output_ids"], [lp[0] for lp in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def _assert_same(a: list[tuple], b: list[tuple], atol: float) -> None:
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        assert ids_a == ids_b
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=atol, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_equals_sparse_and_transformers(backend, model_dir, monkeypatch):
    lens = PROMPT_LENS[backend]
    prompts = _prompts(lens)
    rows = _count_dense(monkeypatch, backend)
    on = _engine(model_dir, backend)
    on_logits = prefill_all_logits(on.scheduler.tp_worker.model_runner, prompts)
    on_out = _greedy(on, prompts)
    assert rows and max(rows) == sum(n for n in lens if DENSE_ABOVE < n <= 256), rows  # the batched prefill
    on.shutdown()
    monkeypatch.setenv(DENSE_PREFILL_ENV[0], "0")
    rows.clear()
    off = _engine(model_dir, backend)
    off_logits = prefill_all_logits(off.scheduler.tp_worker.model_runner, prompts)
    off_out = _greedy(off, prompts)
    assert not rows
    off.shutdown()
    hf = load_hf_reference(model_dir)
    for n, a, b, p in zip(lens, on_logits, off_logits, prompts):
        assert (a - b).abs().max().item() < LOGIT_ATOL, n
        assert (a - hf_prefill_logits(hf, p)).abs().max().item() < LOGIT_ATOL, n
    _assert_same(on_out, off_out, LOGIT_ATOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_dense_chunk_over_a_cached_prefix(backend, model_dir, monkeypatch):
    """Chunks of 128: the second chunk of a 250-token prompt is dense over the first's KV."""
    prompts = _prompts([250])
    rows = _count_dense(monkeypatch, backend)
    on = _greedy(_engine(model_dir, backend, chunked_prefill_size=128), prompts)
    assert 122 in rows, rows  # the second chunk (prefix 128) went dense
    monkeypatch.setenv(DENSE_PREFILL_ENV[0], "0")
    off = _greedy(_engine(model_dir, backend, chunked_prefill_size=128), prompts)
    _assert_same(on, off, LOGIT_ATOL)


def test_rule_decides_by_length_and_cost():
    v32 = DensePrefillRule(2048, 512, 128, 64, 128)
    # whole prompts of 1K / 2K: dense; 64 new tokens over a 1984-token prefix: sparse (decompressing
    # 2048 latents costs more than it saves); over index_topk, or nothing new: sparse
    assert v32.requests([1024, 2048, 2048, 2049, 5], [1024, 2048, 64, 2049, 0]) == [True, True, False, False, False]
    assert DensePrefillRule(0, 512, 128, 64, 128).requests([1024], [1024]) == [False]


class _Cfg:
    index_topk, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim = 2048, 512, 128, 64, 128


def test_threshold_knob(monkeypatch):
    assert dense_prefill_rule(_Cfg, deterministic=False).threshold == 2048  # default: index_topk
    assert dense_prefill_rule(_Cfg, deterministic=True).threshold == 0  # batch-invariant mode: off
    monkeypatch.setenv(DENSE_PREFILL_ENV[1], "1024")  # upstream's newer spelling
    assert dense_prefill_rule(_Cfg, deterministic=False).threshold == 1024
    monkeypatch.setenv(DENSE_PREFILL_ENV[0], "4096")
    with pytest.raises(ValueError, match="SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=4096 must be in"):
        dense_prefill_rule(_Cfg, deterministic=False)
    monkeypatch.setenv(DENSE_PREFILL_ENV[0], "many")
    with pytest.raises(ValueError, match="not an integer"):
        dense_prefill_rule(_Cfg, deterministic=False)
