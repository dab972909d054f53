"""Our DeepseekV2-path model against transformers' reference classes on the same tiny weights.

Tolerance: fp32 everywhere, exact (fp32) index K. Measured max |logit diff| is ~3e-6 on logits of
magnitude ~3; the bound below leaves headroom for BLAS differences across machines while still
catching any real mistake (a wrong rope layout or a dropped token moves logits by >1e-2).
"""

import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.testing.runner_utils import prefill_all_logits
from sglang.srt.testing.reference import hf_greedy_generate, hf_prefill_logits, load_hf_reference

LOGIT_ATOL = 1e-4
PROMPT_LENS = [5, 40, 77, 100]  # index_topk is 32: three of four prompts use sparse selection
NEW_TOKENS = 32
MODELS = ["tiny-deepseek-v32", "tiny-glm-moe-dsa", "tiny-deepseek-v3"]


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=MODELS)
def model_case(request, builtin_path):
    path = builtin_path(request.param)
    return request.param, path, load_hf_reference(path)


# SGLANG_TEST_DEVICE=cuda runs our side on a GPU (the reference stays on CPU in fp32).
DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")


def _engine(path: str, page_size: int, **kw) -> Engine:
    return Engine(model_path=path, dtype="float32", device=DEVICE, page_size=page_size, max_total_tokens=4096,
                  nsa_index_k_dtype="float32", random_seed=0, **kw)


def _prefill_all_logits(engine, prompts):
    return prefill_all_logits(engine.scheduler.tp_worker.model_runner, prompts)


@pytest.mark.parametrize("page_size", [1, 64])
def test_prefill_logits_match_reference(model_case, page_size):
    name, path, hf = model_case
    engine = _engine(path, page_size)
    prompts = _prompts()
    for prompt, ours in zip(prompts, _prefill_all_logits(engine, prompts)):
        ref = hf_prefill_logits(hf, prompt)
        err = (ours - ref).abs().max().item()
        assert err < LOGIT_ATOL, f"{name} page {page_size} len {len(prompt)}: max |diff| {err}"


@pytest.mark.parametrize("page_size", [1, 64])
def test_greedy_tokens_match_reference(model_case, page_size):
    name, path, hf = model_case
    engine = _engine(path, page_size)
    prompts = _prompts()
    outs = engine.generate(input_ids=prompts,
                           sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy_generate(hf, prompt, NEW_TOKENS), f"{name} len {len(prompt)}"
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert engine.scheduler.kv_leak_report() is None


@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_after_cached_prefix_matches_reference(model_case, page_size):
    """Second request extends on top of the first one's cached KV (radix hit)."""
    name, path, hf = model_case
    engine = _engine(path, page_size)
    base, tail = _prompts(2)[3], _prompts(3)[2]
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    engine.generate(input_ids=base, sampling_params=sp)
    out = engine.generate(input_ids=base + tail, sampling_params=sp)
    expect_cached = len(base) // page_size * page_size
    assert out["meta_info"]["cached_tokens"] == expect_cached > 0
    assert out["output_ids"] == hf_greedy_generate(hf, base + tail, NEW_TOKENS), name
    assert engine.scheduler.kv_leak_report() is None


def test_plain_and_absorbed_mla_paths_agree(model_case):
    """The weight-absorbed formulation (decode kernels) equals the plain one (prefill)."""
    name, path, _ = model_case
    prompts = _prompts()
    plain = _prefill_all_logits(_engine(path, 1, mla_attn_path="plain"), prompts)
    absorbed = _prefill_all_logits(_engine(path, 1, mla_attn_path="absorbed"), prompts)
    for a, b in zip(plain, absorbed):
        assert (a - b).abs().max().item() < LOGIT_ATOL, name


@pytest.mark.parametrize("chunked_prefill_size", [-1, 16])
def test_prompt_logprobs_match_reference(model_case, chunked_prefill_size):
    """Input-token logprobs (logprob_start_len) equal log_softmax of the reference logits, also
    across chunked-prefill boundaries; output logprobs equal the reference's next-token logprob."""
    name, path, hf = model_case
    engine = _engine(path, 1, chunked_prefill_size=chunked_prefill_size)
    prompt = _prompts(4)[3]
    ref = torch.log_softmax(hf_prefill_logits(hf, prompt), dim=-1)
    for start in (0, 37):
        out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1},
                              return_logprob=True, logprob_start_len=start, top_logprobs_num=2)
        lps = out["meta_info"]["input_token_logprobs"]
        first = max(start, 1)
        assert len(lps) == len(prompt) - start
        if start == 0:
            assert lps[0][0] is None and lps[0][1] == prompt[0]
            lps = lps[1:]
        expect = [ref[p - 1, prompt[p]].item() for p in range(first, len(prompt))]
        got = [lp for lp, _, _ in lps]
        assert max(abs(a - b) for a, b in zip(got, expect)) < LOGIT_ATOL, (name, start)
        (lp, tid, _), = out["meta_info"]["output_token_logprobs"]
        assert tid == int(ref[-1].argmax()) and abs(lp - ref[-1].max().item()) < LOGIT_ATOL
        assert engine.scheduler.kv_leak_report() is None


def test_query_chunked_prefill_matches_reference(model_case, monkeypatch):
    """Long prefills split each request's queries into score blocks; tiny blocks give the same logits."""
    from sglang.srt.layers.attention.nsa import nsa_backend

    name, path, hf = model_case
    monkeypatch.setattr(nsa_backend, "SCORE_BLOCK_ELEMS", 3000)  # a few queries per block
    assert nsa_backend.query_chunk(4 * 100) == 7
    prompts = _prompts()
    for mla_path in ("plain", "absorbed"):
        for prompt, ours in zip(prompts, _prefill_all_logits(_engine(path, 1, mla_attn_path=mla_path), prompts)):
            assert (ours - hf_prefill_logits(hf, prompt)).abs().max().item() < LOGIT_ATOL, (name, mla_path)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_tied_word_embeddings_match_reference(arch, tmp_path):
    """`tie_word_embeddings`: the checkpoint has no lm_head.weight; the head is the embedding. The
    target matches transformers, and the MTP draft (its head tied too) loads and drafts exactly:
    EAGLE's greedy output equals plain decoding."""
    from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / arch), arch=arch, mtp_layer=True, tie_word_embeddings=True)
    hf = load_hf_reference(path)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    prompts = _prompts(seed=5)[:2]
    plain = _engine(path, 1)
    for prompt, ours in zip(prompts, _prefill_all_logits(plain, prompts)):
        assert (ours - hf_prefill_logits(hf, prompt)).abs().max().item() < LOGIT_ATOL
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ref = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    spec = _engine(path, 1, speculative_algorithm="EAGLE", speculative_num_steps=2)
    assert [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=params)] == ref


# transformers' config fields that change the model's structure, off the builtins' defaults
CONFIG_VARIANTS = [
    ("deepseek_v32", dict(n_shared_experts=0, num_experts_per_tok=1)),  # HF saves [0, H] shared experts
    ("deepseek_v32", dict(n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False)),
    ("deepseek_v32", dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"], attention_bias=True)),
    ("glm_moe_dsa", dict(num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=16, v_head_dim=48,
                         qk_rope_head_dim=32, kv_lora_rank=96, index_topk=16)),
    ("glm_moe_dsa", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                          "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.707, "mscale_all_dim": 0.707})),
]


@pytest.mark.parametrize("arch,overrides", CONFIG_VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(v))
def test_config_variants_match_reference(arch, overrides, tmp_path):
    """Prefill logits vs transformers on checkpoints of other config fields (each matched at ~2e-6).
    index_n_heads stays >= 8: with 4 or fewer index heads, ~5% of the query rows tie at the k-th
    index score (relu zeroes every head), and torch.topk's tie order is its own (ours: the lower
    position), so the two select other keys -- a reference ambiguity, not a mismatch."""
    from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / arch), arch=arch, **overrides)
    hf = load_hf_reference(path)
    prompts = _prompts(seed=3)[1:3]
    for prompt, ours in zip(prompts, _prefill_all_logits(_engine(path, 1), prompts)):
        assert (ours - hf_prefill_logits(hf, prompt)).abs().max().item() < LOGIT_ATOL
