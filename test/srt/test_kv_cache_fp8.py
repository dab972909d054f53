"""FP8 MLA KV cache (`--kv-cache-dtype fp8_e4m3`) through the engine, against the exact cache (the
model dtype, fp32 on CPU), on the builtin tiny DSA models.

The tolerance, derived. A cached latent value x comes back as x(1 + d) with |d| <= EPS = 2^-4 (e4m3
keeps 3 mantissa bits, round to nearest; the per-128 scale maps the block max to 448, so only values
under 2^-6 of their block's max fall in the subnormal range, where the error is <= 2^-10 * max / 448
instead). Latents enter MLA linearly (scores q . c, output sum_j p_j c_j), so to first order each
attention output, hence the residual stream and the final hidden state h, carries a relative error
<= EPS, and each logit z_v moves by <= EPS |z_v|-ish; a logprob lp_t = z_t - logsumexp(z) then moves
by <= 2 EPS max_v |z_v|. On random tiny models max_v |z_v| is about |lp| of a typical token (flat
distributions), so per token |d lp_t| <= 2 EPS |lp_t| = |lp_t| / 8 is the first-order bound. Round
to nearest errors are uniform, so the typical (RMS) error is EPS / sqrt(3): the median |d lp| should
sit well under EPS / sqrt(3) * 2 * median |lp|.

The first-order bound fails where a discrete choice flips on the perturbed hidden state: the MoE
router's expert top-k, the DSA indexer's key top-k (long prompts), and greedy argmax itself. Those
flips are rare but unbounded, so what is asserted (teacher-forced: both caches score the same
tokens, the exact cache's greedy continuation, so flips cannot cascade):
1. median |d lp| <= 2 EPS / sqrt(3) * median |lp|   (the typical error, no flips);
2. at most FLIP_FRACTION of the tokens exceed the per-token first-order bound 2 EPS |lp_t| + 1e-3;
3. the argmax (greedy token) agrees on at least ARGMAX_AGREEMENT of the steps; measured 0.76-0.91
   on these random models, whose top-2 logprob gap has a median of only ~0.1.
Measured (CPU, 6 prompts x 12 tokens per case): median |d lp| 0.018-0.033 against bounds of 0.39-0.50,
0-0.9% of tokens over the per-token bound. Free-running greedy agreement (reported, not asserted) is
lower, 0.14-0.58: after the first near-tie flip the two runs decode different continuations.
A correctness bug (wrong scale, swapped rows, an unwritten page) moves every logprob by nats and
fails (1) outright; the kernels themselves are tested exactly against their twins elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.mem_cache.kv_fp8_format import E4M3_REL_ERR as EPS
from sglang.srt.server_args import ServerArgsError
from sglang.srt.testing.fp8_bounds import assert_within_e4m3_bound, e4m3_logprob_report

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
FLIP_FRACTION = 0.15
ARGMAX_AGREEMENT = 0.7


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def _run(name: str, kv: str, prompts, new: int, **kw):
    """Greedy continuation, then a teacher-forced scoring pass of prompt + `score_with` tokens."""
    engine = Engine(model_path=f"builtin:{name}", device=DEVICE, random_seed=0, max_total_tokens=8192,
                    kv_cache_dtype=kv, **kw)
    try:
        gen = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                                  "ignore_eos": True})
        return engine, [o["output_ids"] for o in gen]
    except BaseException:
        engine.shutdown()
        raise


def _score(engine: Engine, seqs):
    out = engine.generate(input_ids=seqs, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    lps = [[x[0] for x in o["meta_info"]["input_token_logprobs"][1:]] for o in out]
    top = [[x[0][1] for x in o["meta_info"]["input_top_logprobs"][1:]] for o in out]
    return lps, top


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-moe-dsa"])
@pytest.mark.parametrize("lo,hi", [(6, 16), (40, 120)])  # dense (<= index_topk 32 keys), then sparse
def test_fp8_kv_logprobs_within_e4m3_tolerance(name, lo, hi):
    prompts = _prompts(6, lo, hi, seed=5)
    new = 12
    ref_engine, ref_ids = _run(name, "auto", prompts, new)
    seqs = [p + o for p, o in zip(prompts, ref_ids)]
    try:
        ref_lp, ref_top = _score(ref_engine, seqs)
    finally:
        ref_engine.shutdown()
    fp8_engine, fp8_ids = _run(name, "fp8_e4m3", prompts, new)
    try:
        lp, top = _score(fp8_engine, seqs)
    finally:
        fp8_engine.shutdown()
    stats = e4m3_logprob_report(ref_lp, lp, ref_top, top, ref_ids, fp8_ids, EPS)
    assert_within_e4m3_bound(stats, f"{name} prompts {lo}-{hi}", FLIP_FRACTION, ARGMAX_AGREEMENT)


def test_fp8_kv_capacity_and_bad_combos():
    """The same byte budget (the CPU KV budget, no --max-total-tokens) holds > 2x the tokens (fp32 tiny
    model: 100 vs 320 B/token/layer of MLA KV, plus the same index K), and the start-up log says so;
    dims the format cannot align, or an unknown dtype, fail naming the flag."""
    import logging

    from sglang.srt.configs.model_config import model_config_from_server_args

    caps, lines = {}, []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    log = logging.getLogger("sglang.srt.model_executor.model_runner")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        for kv in ("auto", "fp8_e4m3"):
            e = Engine(model_path="builtin:tiny-deepseek-v32", device=DEVICE, random_seed=0, kv_cache_dtype=kv)
            caps[kv] = e.scheduler.max_total_num_tokens
            e.shutdown()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    assert caps["fp8_e4m3"] / caps["auto"] > 2.0, caps
    assert any("kv cache dtype fp8_e4m3" in x and str(caps["fp8_e4m3"]) in x for x in lines), lines
    assert any("the tokens in the same memory" in x for x in lines), lines
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ServerArgsError, match="--kv-cache-dtype"):
        ServerArgs(model_path="builtin:tiny-deepseek-v32", kv_cache_dtype="fp8").validate()
    bad = ServerArgs(model_path="builtin:tiny-deepseek-v32", device="cpu", kv_cache_dtype="fp8_e4m3",
                     json_model_override_args='{"qk_rope_head_dim": 15}').resolve()
    with pytest.raises(ServerArgsError, match="--kv-cache-dtype"):
        model_config_from_server_args(bad)


def test_triton_kernels_read_fp8_kv_like_the_torch_backend(builtin_path):
    """Both backends read the same dequantised values: prefill logits (every position; the extend kernel
    over FP8 rows the store kernel wrote) within fp32 rounding, and the same greedy tokens (split-K decode
    kernel). Interpreter on CPU; index K exact so only the MLA KV format differs from test_triton_backends."""
    from sglang.srt.testing.runner_utils import prefill_all_logits

    path = builtin_path("tiny-deepseek-v32")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (5, 45)]
    runs = {}
    for backend in ("torch", "triton"):
        e = Engine(model_path=path, dtype="float32", device=DEVICE, page_size=64, max_total_tokens=1024,
                   nsa_index_k_dtype="float32", random_seed=0, disable_cuda_graph=True, kv_cache_dtype="fp8_e4m3",
                   nsa_prefill_backend=backend, nsa_decode_backend=backend, moe_runner_backend=backend)
        try:
            assert e.scheduler.tp_worker.model_runner.token_to_kv_pool.kv_buffer[0].dtype == torch.uint8
            logits = prefill_all_logits(e.scheduler.tp_worker.model_runner, prompts)
            ids = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": 4, "ignore_eos": True})]
        finally:
            e.shutdown()
        runs[backend] = (logits, ids)
    for a, b in zip(runs["torch"][0], runs["triton"][0]):
        assert (a - b).abs().max().item() < 1e-4
    assert runs["torch"][1] == runs["triton"][1]


# On a GPU the CP ranks compute a page's latents in other shapes than cp = 1 (bf16 rounding differs by
# an ulp), and the FP8 store turns an ulp at a rounding boundary into a whole e4m3 step: the H100
# measured 1.0e-2 with equal tokens. CPU (fp32, shape-exact) keeps the tight bound.
CP_FP8_TOL = 1e-4 if DEVICE == "cpu" else 3e-2


def test_context_parallel_moves_fp8_pages_as_bytes(builtin_path):
    """CP ranks share KV through raw page moves (get/set_kv_pages): cp = 2 with FP8 KV gives cp = 1's
    tokens and logprobs (both FP8), for both split modes."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    key = builtin_path("tiny-deepseek-v32")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (45, 3, 70)]
    base = dict(model_path=key, page_size=16, chunked_prefill_size=-1, device=DEVICE, kv_cache_dtype="fp8_e4m3")
    cases = [Case(f"cp-{m}", dict(base, enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode=m), prompts,
                  4, return_logprob=True) for m in ("in-seq-split", "round-robin-split")]
    ref = run_case(Case("ref", base, prompts, 4, return_logprob=True), 1)
    for case, got in zip(cases, run_multi_rank(cases, 2)):
        for k in ("p0", "p1", "p2"):
            assert got[k]["ids"] == ref[k]["ids"], case.name
            assert max(abs(a - b) for a, b in zip(got[k]["logprobs"], ref[k]["logprobs"])) < CP_FP8_TOL, case.name


LOGPROB_RTOL = 1e-5  # ~20 fp32 ulps: rounding, never a wrong page (that moves logprobs by >= 1e-2)


def test_hicache_reload_of_fp8_pages_equals_fresh_prefill():
    """HiCache moves the FP8 rows as raw bytes (layout() / page_payloads()): a prompt evicted to the host and
    loaded back gives the tokens and logprobs of a fresh prefill over the FP8 cache."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 1000, (120,), generator=g).tolist()
    fillers = [torch.randint(5, 1000, (120,), generator=g).tolist() for _ in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    kw = dict(model_path="builtin:tiny-deepseek-v32", device=DEVICE, random_seed=0, max_total_tokens=256,
              page_size=1, kv_cache_dtype="fp8_e4m3")
    fresh = Engine(disable_radix_cache=True, **kw)
    try:
        want = fresh.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
    finally:
        fresh.shutdown()
    eng = Engine(enable_hierarchical_cache=True, hicache_write_policy="write_through", **kw)
    try:
        lo = eng.scheduler.tp_worker.model_runner.token_to_kv_pool.layout()
        assert (lo.dtype, lo.kv_row_bytes, lo.kv_cache_dtype) == (torch.uint8, 100, "fp8_e4m3")
        eng.generate(input_ids=prompt, sampling_params=sp)
        for f in fillers:
            eng.generate(input_ids=f, sampling_params=sp)
        tc = eng.scheduler.tree_cache
        tc.controller.wait_idle()
        tc.check_events()
        assert tc.match_prefix(prompt).host_hit_length >= 60, "the prompt's KV should have moved to the host"
        got = eng.generate(input_ids=prompt, sampling_params=sp, return_logprob=True)
        assert got["meta_info"]["cached_tokens"] >= 100 and tc.stats["loaded_tokens"] >= 100
        assert got["output_ids"] == want["output_ids"]
        # The reloaded bytes are the fresh prefill's (the KV itself is compared byte for byte in
        # test_hicache); the logprobs come from an extend over the cached prefix instead of a whole
        # prefill, whose fp32 rounding may differ in the last bits (CI saw 1 ulp, 4.8e-7 at -4.97).
        for (a, ta, _), (b, tb, _) in zip(got["meta_info"]["output_token_logprobs"],
                                          want["meta_info"]["output_token_logprobs"], strict=True):
            assert ta == tb and abs(a - b) <= LOGPROB_RTOL * max(1.0, abs(b)), (a, b)
    finally:
        eng.shutdown()


def test_eagle_with_fp8_kv_equals_plain_decoding_with_fp8_kv():
    """The NextN draft's pool takes the same format (planned together with the target's); greedy speculative
    output equals plain decoding, both over FP8 KV."""
    prompts = [[(7 * i + 13 * j) % 900 + 5 for j in range(9 + 6 * i)] for i in range(3)]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    kw = dict(model_path="builtin:tiny-deepseek-v32-mtp", device=DEVICE, random_seed=0, max_total_tokens=4096,
              kv_cache_dtype="fp8_e4m3")
    plain = Engine(**kw)
    try:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=sp)]
    finally:
        plain.shutdown()
    spec = Engine(speculative_algorithm="EAGLE", speculative_num_steps=3, **kw)
    try:
        worker = spec.scheduler.tp_worker
        pools = list(worker.kv_pools().values())
        assert all(p.kv_fp8 for p in pools)
        assert [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=sp)] == want
    finally:
        spec.shutdown()
