"""The scheduler's worker seam with N tokens per request (issue 18 item 2).

A fake worker (sglang.srt.testing.fake_workers.RandomAcceptWorker) gets N decode rows per request
and accepts a random 0..N of them, producing the tokens plain greedy decoding would. A scheduler
that commits exactly the accepted KV rows, frees the rest and appends tokens right reproduces plain
decoding exactly: output ids, logprobs, finish reasons, stop strings, max_tokens; the radix cache
serves the KV those steps committed (a second round extends the first round's outputs); and the KV
pool is whole afterwards (free + cached == capacity), retractions under memory pressure included.
"""

import os

import pytest

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.testing.fake_workers import RandomAcceptWorker

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
MODEL = "builtin:tiny-deepseek-v32"
# On a GPU an N-row step runs in another batch shape than plain decoding's row, and cuBLAS picks its
# kernels by shape (bf16 logprobs move by ~1e-2): exact equality holds under batch-invariant kernels.
EXACT = {"enable_deterministic_inference": True} if DEVICE == "cuda" else {}


def _engine(page_size: int, capacity: int, **kw) -> Engine:
    return Engine(model_path=MODEL, device=DEVICE, random_seed=0, page_size=page_size,
                  max_total_tokens=capacity, **{**EXACT, **kw})


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 900 + 5 for j in range(9 + 5 * i)] for i in range(n)]


def _run(engine: Engine, prompts, params):
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)


def _where(a, b) -> str:
    """Where two outputs part, and how close plain's top-2 were there (a near-tie is numerics, a wide
    gap a scheduling bug): the message a GPU failure needs."""
    i = next(j for j, (x, y) in enumerate(zip(a["output_ids"] + [None], b["output_ids"] + [None])) if x != y)
    tops = b["meta_info"]["output_top_logprobs"]
    gap = tops[i][0][0] - tops[i][1][0] if i < len(tops) and len(tops[i]) > 1 else float("nan")
    return f"part at token {i} of {len(b['output_ids'])}: plain's top-2 gap there {gap:.3g} nats"


def _assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a["output_ids"] == b["output_ids"], _where(a, b)
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"]
        la = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
        lb = [t[0] for t in b["meta_info"]["output_token_logprobs"]]
        assert len(la) == len(lb) and all(abs(x - y) < 1e-4 for x, y in zip(la, lb))
        ta = [[i for _, i, *_ in step] for step in a["meta_info"]["output_top_logprobs"]]
        tb = [[i for _, i, *_ in step] for step in b["meta_info"]["output_top_logprobs"]]
        assert ta == tb


def _assert_kv_whole(engine: Engine):
    s = engine.scheduler
    assert not s.has_work() and s.kv_leak_report() is None
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens
    assert s.tree_cache.protected_size() == 0


@pytest.mark.parametrize("page_size,n,capacity", [(1, 3, 4096), (4, 4, 4096), (4, 3, 192)])
def test_random_accept_counts_equal_plain_decoding(page_size, n, capacity):
    prompts = _prompts(6)
    plain = _engine(page_size, capacity)
    ref_free = plain.scheduler.allocator.available_size()
    # A stop string taken from the middle of a plain output, so it fires mid-step.
    probe = plain.generate(input_ids=prompts[2], sampling_params={"temperature": 0, "max_new_tokens": 24,
                                                                  "ignore_eos": True})
    stop = probe["text"][len(probe["text"]) // 2: len(probe["text"]) // 2 + 3]
    params = [{"temperature": 0, "max_new_tokens": 5 + 7 * (i % 4), "ignore_eos": i % 2 == 0,
               **({"stop": [stop]} if i == 2 and stop.strip() else {})} for i in range(len(prompts))]
    plain.flush_cache()
    assert plain.scheduler.allocator.available_size() == ref_free
    ref = _run(plain, prompts, params)

    fake = _engine(page_size, capacity)
    start_free = fake.scheduler.allocator.available_size()
    worker = RandomAcceptWorker(fake.scheduler.tp_worker, n, seed=page_size * 10 + n)
    fake.scheduler.tp_worker = worker
    ours = _run(fake, prompts, params)
    _assert_same(ours, ref)
    assert 0 in worker.accepted_hist and n in worker.accepted_hist  # rejections and full accepts ran
    _assert_kv_whole(fake)

    # Round 2 hits the radix cache on KV the fake steps committed (prompt + outputs).
    prompts2 = [p + o["output_ids"][:-1] + [11] for p, o in zip(prompts, ref)]
    params2 = [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}] * len(prompts)
    ours2 = _run(fake, prompts2, params2)
    ref2 = _run(plain, prompts2, params2)
    if capacity >= 4096:  # nothing was evicted: both caches hold the same prefixes (the small pool evicts
        # by recency, and the fake's steps differ in timing); an extend over another cached length is
        # other arithmetic on a GPU, so an output difference there would not be the scheduler's
        assert [o["meta_info"]["cached_tokens"] for o in ours2] == [o["meta_info"]["cached_tokens"] for o in ref2]
    assert sum(o["meta_info"]["cached_tokens"] for o in ours2) > 0
    _assert_same(ours2, ref2)
    _assert_kv_whole(fake)
    assert fake.flush_cache() and fake.scheduler.allocator.available_size() == start_free


def test_retraction_with_n_tokens_per_request():
    """A pool that cannot hold every request's N-row steps: requests are retracted and re-run, and
    the outputs still equal plain decoding with nothing leaked."""
    prompts = _prompts(5)
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    ref = _run(_engine(4, 4096), prompts, params)
    fake = _engine(4, 128)  # two requests fit at admission, not once they have grown
    fake.scheduler.tp_worker = RandomAcceptWorker(fake.scheduler.tp_worker, 4, seed=7)
    retracted = []
    decode = fake.scheduler.decode_manager
    orig = decode.retract_decode

    def spy(running, waiting_queue, n):
        before = len(fake.scheduler.waiting_queue)
        orig(running, waiting_queue, n)
        retracted.append(len(fake.scheduler.waiting_queue) - before)

    decode.retract_decode = spy
    ours = _run(fake, prompts, params)
    assert max(retracted) > 0
    noise = _recompute_noise(prompts, ref)
    if DEVICE == "cuda":
        # A retracted request's KV is recomputed by a prefill, whose attention is other arithmetic than
        # the decode steps that made plain's (deterministic mode fixes the batch, not the kernel): the
        # outputs may part only at a near-tie within the prefill-vs-decode noise of this run.
        from sglang.srt.testing.spec_drafts import verify_tolerance, within_tolerance_violation

        tol = verify_tolerance(noise)
        assert within_tolerance_violation(ref, ours, tol) is None, within_tolerance_violation(ref, ours, tol)
    else:  # on CPU a prefill of a token is its decode step up to fp32 rounding, and outputs are exact
        assert noise < 1e-5, noise
        _assert_same(ours, ref)
    _assert_kv_whole(fake)


def _recompute_noise(prompts, ref) -> float:
    """Largest |logprob| difference of plain's output tokens decoded vs recomputed by one prefill of
    prompt + output (an engine without prefix cache)."""
    eng = _engine(4, 4096, disable_radix_cache=True)
    worst = 0.0
    for p, r in zip(prompts, ref):
        out = eng.generate(input_ids=p + r["output_ids"][:-1], sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, logprob_start_len=len(p) - 1)
        inputs = [t[0] for t in out["meta_info"]["input_token_logprobs"]]  # p[-1], then the outputs but the last
        again = inputs[len(inputs) - (len(r["output_ids"]) - 1):] + [out["meta_info"]["output_token_logprobs"][0][0]]
        decoded = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(again, decoded)))
    return worst
