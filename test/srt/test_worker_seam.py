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


def _assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a["output_ids"] == b["output_ids"]
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
    assert sum(o["meta_info"]["cached_tokens"] for o in ours2) > 0
    _assert_same(ours2, _run(plain, prompts2, params2))
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
    _assert_same(_run(fake, prompts, params), ref)
    assert max(retracted) > 0
    _assert_kv_whole(fake)
