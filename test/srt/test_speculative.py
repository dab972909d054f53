"""EAGLE / NextN speculative decoding (issue 19) on the builtin models' MTP layer.

Lossless: the same tokens (and logprobs) as plain decoding -- with the random draft (which accepts
almost nothing), with a draft forced to propose the target's own tokens (accepts every draft: the
accept path runs) and with one forced wrong (accepts nothing). Sampling with per-request seeds
gives exactly plain decoding's tokens too (each verified row draws with the seed step plain
decoding uses). Chunked prefill, radix hits, stop strings, max_tokens inside an accepted run,
grammars (verified one row at a time), IndexCache-shared target layers and retraction under a
small KV pool; the pool is whole afterwards.
"""

import json
import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.testing.spec_drafts import forced_drafts

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
MODEL = "builtin:tiny-deepseek-v32-mtp"
# On a GPU a verify row runs in another batch shape than plain decoding's row (b * n rows vs b), and
# cuBLAS picks its kernels by shape: exact equality holds under batch-invariant kernels, which is
# what these tests check there. The default mode's bound is test_default_mode_verify_within_tolerance.
EXACT = {"enable_deterministic_inference": True} if DEVICE == "cuda" else {}
EXACT_FLAGS = ["--enable-deterministic-inference"] if DEVICE == "cuda" else []


def _engine(spec: bool, model: str = MODEL, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    kw = {**EXACT, **kw}
    if spec:
        kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, **kw)
    return Engine(model_path=model, device=DEVICE, random_seed=0, **kw)


# The radix-hit rounds need a whole KV page cached: 64 tokens per page by default on CUDA (1 on CPU).
RADIX_PAD = 64 if DEVICE == "cuda" else 0


def _prompts(n: int, pad: int = 0) -> list[list[int]]:
    """`pad` more tokens per prompt (RADIX_PAD: a page the radix cache can hand back)."""
    return [[(7 * i + 13 * j) % 900 + 5 for j in range(9 + 6 * i + pad)] for i in range(n)]


def _key(o: dict) -> tuple:
    m = o["meta_info"]
    lps = tuple(round(t[0], 4) for t in m.get("output_token_logprobs") or [])
    return o["output_ids"], str(m["finish_reason"]), m["completion_tokens"], lps


def _count_graph_replays(worker) -> dict[str, int]:
    """Counts replays of the target's and the draft's CUDA graphs (none on CPU: no runner)."""
    counts = {"target": 0, "draft": 0}
    for name, runner in (("target", worker.target.model_runner), ("draft", worker.draft_runner)):
        g = runner.cuda_graph_runner
        if g is None:
            continue
        replay = g.replay

        def counted(fb, _replay=replay, _name=name):
            counts[_name] += 1
            return _replay(fb)

        g.replay = counted
    return counts


def _whole(engine: Engine) -> None:
    s = engine.scheduler
    assert not s.has_work() and s.kv_leak_report() is None
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens


@pytest.mark.parametrize("engine_kw", [dict(), dict(chunked_prefill_size=8, page_size=4)],
                         ids=["default", "chunked_page4"])
def test_greedy_equals_plain_with_random_right_and_wrong_drafts(engine_kw):
    prompts = _prompts(5, RADIX_PAD if "page_size" not in engine_kw else 0)
    params = [{"temperature": 0, "max_new_tokens": 6 + 5 * i, "ignore_eos": True} for i in range(5)]
    gen = dict(return_logprob=True, top_logprobs_num=2)
    plain = _engine(False, **engine_kw)
    ref = plain.generate(input_ids=prompts, sampling_params=params, **gen)
    spec = _engine(True, **engine_kw)
    worker = spec.scheduler.tp_worker
    assert worker.num_tokens_per_req == 4
    replays = _count_graph_replays(worker)
    outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
    if DEVICE == "cuda":  # both the target verify and the draft decode ran from their CUDA graphs
        assert replays["target"] and replays["draft"], replays
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    m = outs[0]["meta_info"]  # upstream's fields: completion tokens per verify step
    assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] == m["completion_tokens"] / m["spec_verify_ct"]
    assert spec.scheduler.get_stats().avg_spec_accept_length == worker.avg_accept_length >= 1.0
    _whole(spec)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    for mode in ("right", "wrong", "mixed"):
        assert spec.flush_cache()
        worker.draft_override = forced_drafts(targets, mode)
        worker.num_verify_steps = worker.num_accepted_drafts = 0
        outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
        assert [_key(o) for o in outs] == [_key(o) for o in ref]
        # forced right: 3 drafts + the bonus token per verify, except where max_tokens cut a run
        expect = {"right": (3.0, 4.0), "wrong": (1.0, 1.0), "mixed": (1.2, 3.0)}[mode]
        assert expect[0] <= worker.avg_accept_length <= expect[1], (mode, worker.avg_accept_length)
        _whole(spec)
    # Radix hits on KV (target and draft) that verify steps committed: a second round extends the
    # outputs, as plain decoding's second round extends from its own cache (an extend over a cached
    # prefix is other arithmetic than a fresh prefill on a GPU, deterministic mode or not).
    worker.draft_override = None
    prompts2 = [p + r["output_ids"][:-2] for p, r in zip(prompts, ref)]
    p2 = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    ours = spec.generate(input_ids=prompts2, sampling_params=p2, **gen)
    theirs = plain.generate(input_ids=prompts2, sampling_params=p2, **gen)
    assert [o["meta_info"]["cached_tokens"] for o in ours] == [o["meta_info"]["cached_tokens"] for o in theirs]
    assert sum(o["meta_info"]["cached_tokens"] for o in ours) > 0
    assert [_key(o) for o in ours] == [_key(o) for o in theirs]
    if DEVICE == "cpu":  # on CPU an extend over a cached prefix is exactly a fresh prefill
        assert [_key(o) for o in ours] == [_key(o) for o in _engine(False, **engine_kw).generate(
            input_ids=prompts2, sampling_params=p2, **gen)]
    _whole(spec)


@pytest.mark.parametrize("adaptive", [False, True], ids=["drafting", "adaptive"])
def test_forced_decode_step_reads_nothing_back(adaptive):
    """A speculative decode step reads nothing back to the host, forced drafts included: the forced
    drafts (the benchmark's right / wrong modes) gather on the device, so a forced step keeps the
    overlap a natural one has (their host read of the KV lengths once waited for the step in
    flight every step and exposed the launches: bench_speculative timed the hook). Output equals
    plain's with every draft accepted. The model forwards run unguarded (their own no-sync test is
    test_triton_backends.py; the CPU MoE reference reads routing back): this checks the step's glue.
    `adaptive`: --speculative-adaptive with wrong drafts, so most steps run without drafts."""
    from sglang.srt.testing.sync_guard import host_sync_allowed, no_host_sync

    prompts = _prompts(3)
    params = [{"temperature": 0, "max_new_tokens": 9 + 4 * i, "ignore_eos": True} for i in range(3)]
    ref = _engine(False).generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, speculative_adaptive=adaptive)
    worker = spec.scheduler.tp_worker
    decode, steps = worker._decode, []

    def guarded(batch, drafting=True):
        with no_host_sync():
            out = decode(batch, drafting)
        steps.append(drafting)
        return out

    worker._decode = guarded
    for runner in (worker.target.model_runner, worker.draft_runner):
        def forward(fb, _orig=runner.forward):
            with host_sync_allowed():
                return _orig(fb)
        runner.forward = forward
    for mode in ("wrong",) if adaptive else ("right", "mixed"):
        worker.draft_override = forced_drafts({tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}, mode)
        worker.num_verify_steps = worker.num_accepted_drafts = 0
        outs = spec.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref], mode
        if adaptive:
            assert steps.count(False) > steps.count(True) > 0, steps
        else:
            assert steps and worker.avg_accept_length >= (3.0 if mode == "right" else 1.2), mode
    _whole(spec)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_adaptive_turns_failing_drafts_off_and_keeps_output(overlap):
    """--speculative-adaptive: with every draft wrong the worker soon decodes without drafts (a
    speculative probe every 16 steps), with every draft right it never stops drafting; output and
    logprobs equal plain decoding's either way, the pool whole afterwards. Under overlap the steps
    without drafts are device-resident too: each is launched while the step before is in flight."""
    prompts = _prompts(3)
    params = [{"temperature": 0, "max_new_tokens": 40 + 4 * i, "ignore_eos": True} for i in range(3)]
    gen = dict(return_logprob=True, top_logprobs_num=2)
    ref = _engine(False).generate(input_ids=prompts, sampling_params=params, **gen)
    spec = _engine(True, speculative_adaptive=True, disable_overlap_schedule=not overlap)
    worker = spec.scheduler.tp_worker
    counts = {"drafted": 0, "plain": 0, "plain_in_flight": 0}
    decode, overlap_state = worker._decode, spec.scheduler.overlap

    def counted(batch, drafting=True):
        counts["drafted" if drafting else "plain"] += 1
        prev = overlap_state.launched.batch if overlap_state.launched is not None else None
        counts["plain_in_flight"] += not drafting and prev is not None and prev.forward_mode.is_decode()
        return decode(batch, drafting)
    worker._decode = counted
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    for mode in ("wrong", "right"):
        worker.adaptive.reset()  # a fresh policy per round
        counts.update(drafted=0, plain=0, plain_in_flight=0)
        worker.draft_override = forced_drafts(targets, mode)
        outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
        assert [_key(o) for o in outs] == [_key(o) for o in ref], mode
        if mode == "wrong":  # off after a handful of failed steps, then one probe per 16
            assert counts["plain"] > 3 * counts["drafted"] and not worker.adaptive.drafting, counts
            if overlap:  # (a request's last step and the first after a prefill have none in flight)
                assert counts["plain_in_flight"] > counts["plain"] // 2, counts
        else:
            assert counts["plain"] == 0 and worker.adaptive.drafting, counts
        _whole(spec)


def test_default_mode_verify_within_tolerance():
    """Without --enable-deterministic-inference (the default; on a GPU verify rows and plain rows run
    other GEMM kernels): every speculative output -- natural, forced right / wrong / mixed drafts --
    equals plain decoding within the bound of testing/spec_drafts.py: logprobs within SAFETY x the
    batch-shape noise plain decoding itself shows in this run (alone vs batched), and a first
    differing token only where plain's top-2 are that close. On CPU the noise is fp32 rounding."""
    from sglang.srt.testing.spec_drafts import batch_shape_noise, verify_tolerance, within_tolerance_violation

    prompts = _prompts(5)
    params = [{"temperature": 0, "max_new_tokens": 6 + 3 * i, "ignore_eos": True} for i in range(5)]
    gen = dict(return_logprob=True, top_logprobs_num=10)  # a flip may land past the top-2
    off = {"enable_deterministic_inference": False}
    plain = _engine(False, **off)
    ref = plain.generate(input_ids=prompts, sampling_params=params, **gen)
    alone = [plain.generate(input_ids=p, sampling_params=sp, **gen) for p, sp in zip(prompts, params)]
    noise = batch_shape_noise(alone, ref)
    tol = verify_tolerance(noise)
    if DEVICE == "cpu":
        assert noise < 1e-5  # CPU decoding is batch-invariant up to fp32 rounding of the log-softmax
    spec = _engine(True, **off)
    worker = spec.scheduler.tp_worker
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    for mode in ("natural", "right", "wrong", "mixed"):
        worker.draft_override = None if mode == "natural" else forced_drafts(targets, mode)
        assert spec.flush_cache()
        outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
        assert within_tolerance_violation(ref, outs, tol) is None, (mode, noise, within_tolerance_violation(
            ref, outs, tol))
        _whole(spec)
    # the rule has power: a token that is not a near-tie of plain's is refused
    bad = [dict(o, output_ids=list(o["output_ids"])) for o in ref]
    bad[0]["output_ids"][0] = (bad[0]["output_ids"][0] + 1) % 1000
    top = ref[0]["meta_info"]["output_top_logprobs"][0]
    if bad[0]["output_ids"][0] != top[1][1] or top[0][0] - top[1][0] > 2 * tol:
        assert within_tolerance_violation(ref, bad, tol) is not None


@pytest.mark.parametrize("engine_kw", [dict(), dict(chunked_prefill_size=8, page_size=4, max_total_tokens=256)],
                         ids=["default", "chunked_page4_small_pool"])
def test_overlap_launches_the_next_verify_before_the_previous_is_processed(engine_kw):
    """Overlap with speculation: each verify after the first is launched while the previous one is
    still unprocessed (its acceptance unknown to the host), from device-resident lengths and
    tokens; outputs and logprobs equal plain decoding and speculation without overlap, forced
    right / wrong / mixed drafts alike; a pool small enough to retract stays whole."""
    prompts = _prompts(6, RADIX_PAD if "page_size" not in engine_kw else 0)
    params = [{"temperature": 0, "max_new_tokens": 8 + 3 * i, "ignore_eos": i % 2 == 0} for i in range(6)]
    gen = dict(return_logprob=True, top_logprobs_num=2)
    plain = _engine(False, **engine_kw)
    ref = plain.generate(input_ids=prompts, sampling_params=params, **gen)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    sync = _engine(True, disable_overlap_schedule=True, **engine_kw)
    spec = _engine(True, **engine_kw)
    sched = spec.scheduler
    assert sched.overlap.active(sched.tp_worker) and not sync.scheduler.overlap.active(sync.scheduler.tp_worker)
    overlapped = []
    launch = sched.tp_worker.forward_batch_generation

    def spy(batch):
        prev = sched.overlap.launched.batch if sched.overlap.launched is not None else None
        if batch.forward_mode.is_decode():
            overlapped.append(prev is not None and prev.forward_mode.is_decode())
        return launch(batch)

    sched.tp_worker.forward_batch_generation = spy
    for mode in ("right", "wrong", "mixed"):
        for e in (sync, spec):
            e.scheduler.tp_worker.draft_override = forced_drafts(targets, mode)
            assert e.flush_cache()
        outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
        assert [_key(o) for o in outs] == [_key(o) for o in ref], mode
        assert [_key(o) for o in sync.generate(input_ids=prompts, sampling_params=params, **gen)] == [
            _key(o) for o in ref], mode
        _whole(spec)
        _whole(sync)
    assert sum(overlapped) > len(overlapped) // 2, overlapped
    # radix hits: the same prompts again, without a flush, reuse their cached prefixes (compared with
    # plain decoding's own second round: see test_greedy_equals_plain_...)
    outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
    again = plain.generate(input_ids=prompts, sampling_params=params, **gen)
    assert [_key(o) for o in outs] == [_key(o) for o in again]
    if DEVICE == "cpu":
        assert [_key(o) for o in outs] == [_key(o) for o in ref]
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    _whole(spec)


def test_stop_strings_eos_seeds_grammar_and_indexcache():
    """GLM-5 tiny model with shared top-k layers: stop strings inside an accepted run, EOS, seeded
    sampling (exact), a regex grammar (verified one row at a time) in the same batch."""
    model = "builtin:tiny-glm-moe-dsa-mtp"
    prompts = _prompts(4)
    plain = _engine(False, model)
    probe = plain.generate(input_ids=prompts[1], sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                                   "ignore_eos": True})
    stop = probe["text"][len(probe["text"]) // 2:][:3]
    params = [{"temperature": 0, "max_new_tokens": 12},
              {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": [stop]},
              {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 3, "max_new_tokens": 12, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 12, "regex": "(yes|no)[a-d]{2,6}"}]
    ref = plain.generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, model)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    spec.scheduler.tp_worker.draft_override = forced_drafts(targets, "right")
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert outs[3]["meta_info"]["finish_reason"]["type"] == "stop"
    _whole(spec)


def _row_keys(fb) -> list[tuple[int, int]]:
    return list(zip(fb.req_pool_indices[fb.token_to_req].tolist(), fb.positions.tolist()))


@pytest.mark.parametrize("model,shares,kw", [("builtin:tiny-glm-moe-dsa-mtp", True, {}),
                                             (MODEL, True, {"nsa_index_topk_freq": 4}), (MODEL, False, {})],
                         ids=["glm5-config-sharing", "v32-freq4", "v32-no-sharing"])
def test_draft_extends_reuse_the_targets_topk_when_sharing(model, shares, kw):
    """IndexCache through the worker: with sharing on, every draft extend (after a prefill, after a
    verify) is handed the target's last-layer top-k of exactly its rows -- the rows the target
    computed at those positions -- and the draft decode steps score for themselves; sharing off,
    nothing is handed. Greedy output equals plain decoding either way."""
    prompts = [[(11 * i + 7 * j) % 900 + 5 for j in range(40 + 9 * i)] for i in range(3)]  # > index_topk
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    ref = _engine(False, model, **kw).generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, model, **kw)
    worker = spec.scheduler.tp_worker
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    worker.draft_override = forced_drafts(targets, "mixed")
    seen = []
    draft_forward, target_forward = worker.draft_runner.forward, worker.target.model_runner.forward
    last_target = {}

    def target_spy(fb):
        lo = target_forward(fb)
        last_target.update(topk=lo.topk_indices, rows=_row_keys(fb))
        return lo

    def draft_spy(fb):
        topk = fb.spec.topk_indices
        if topk is not None:  # the handed rows are the target's rows of the same request + position
            rows = [last_target["rows"].index(k) for k in _row_keys(fb)]
            assert torch.equal(topk, last_target["topk"][rows])
            assert bool((topk.long() <= fb.positions[:, None]).all())
        # a draft extend (after a prefill: extend-shaped; after a verify: decode-shaped rows that
        # pick the accepted row's logits) vs a chain step (one decode row per request)
        seen.append((fb.forward_mode.is_extend() or fb.logits_row_indices is not None, topk is not None))
        return draft_forward(fb)

    worker.target.model_runner.forward, worker.draft_runner.forward = target_spy, draft_spy
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    extends = [handed for is_ext, handed in seen if is_ext]
    decodes = [handed for is_ext, handed in seen if not is_ext]
    assert len(extends) >= 3 and decodes
    assert all(extends) if shares else not any(extends)
    assert not any(decodes)
    _whole(spec)


def test_draft_decode_through_its_graph_spec():
    """The draft's decode steps as a CUDA-graph spec (hidden state in, hidden state out), replayed
    with the CPU stand-in of a graph: the same tokens as plain decoding, every draft decode step
    replayed (padded buckets included), drafts accepted as when eager."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraphBackend
    from sglang.srt.speculative.eagle_worker import draft_decode_spec

    prompts = _prompts(3)
    # 6 tokens: 5 verifies, each with 2 replayed draft decode steps (interpreted kernels: each step costs)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    # the Triton kernels (interpreted on CPU) are the capturable backends
    kw = dict(nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
    ref = _engine(False, **kw).generate(input_ids=prompts, sampling_params=params)
    eager = _engine(True, **kw)
    eager_out = eager.generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, cuda_graph_max_bs=4, max_running_requests=4, **kw)
    worker = spec.scheduler.tp_worker
    dr = worker.draft_runner
    runner = CudaGraphRunner(dr, EagerGraphBackend(), specs=(draft_decode_spec(worker.draft_config),))
    dr.cuda_graph_runner = runner
    replays = []
    replay = runner.replay
    runner.replay = lambda fb: (replays.append(fb.batch_size), replay(fb))[1]
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    assert worker.avg_accept_length == eager.scheduler.tp_worker.avg_accept_length
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager_out]
    # 2 draft decode steps per verify (num_steps 3), batch 3 -> the padded bucket 4
    assert replays and set(replays) <= {1, 2, 3} and 3 in replays
    _whole(spec)


def test_adaptive_steps_without_drafts_replay_the_draft_graph():
    """--speculative-adaptive with every draft wrong: after the first failed step the worker decodes
    without drafts, and the draft's catch-up row of each such step replays the draft_decode graph
    (CPU stand-in) instead of an eager extend; output equals plain decoding's."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraphBackend
    from sglang.srt.speculative.eagle_worker import draft_decode_spec

    prompts = _prompts(2)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    kw = dict(nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
    ref = _engine(False, **kw).generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, speculative_adaptive=True, cuda_graph_max_bs=4, max_running_requests=4, **kw)
    worker = spec.scheduler.tp_worker
    worker.draft_override = forced_drafts({tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}, "wrong")
    dr = worker.draft_runner
    runner = CudaGraphRunner(dr, EagerGraphBackend(), specs=(draft_decode_spec(worker.draft_config),))
    dr.cuda_graph_runner = runner
    calls = {"steps": 0, "replays": 0}
    in_step = [False]
    replay, decode = runner.replay, worker._decode

    def counted_step(batch, drafting=True):
        calls["steps"] += not drafting
        in_step[0] = not drafting
        try:
            return decode(batch, drafting)
        finally:
            in_step[0] = False

    def counted_replay(fb):
        calls["replays"] += in_step[0]
        return replay(fb)

    worker._decode, runner.replay = counted_step, counted_replay
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    assert calls["steps"] >= 3 and calls["replays"] == calls["steps"], calls  # one replay per step
    _whole(spec)


def test_target_verify_through_its_graph_spec():
    """The target's verify as a CUDA-graph spec (decode-shaped: a row per verified token, buckets
    of bs * n rows), replayed with the CPU stand-in of a graph on the Triton kernels: the same
    tokens as plain decoding and as the eager verify, drafts accepted as when eager (forced right
    and wrong alike), every verify replayed, the top-k handed to the draft from the graph's output
    when IndexCache shares (GLM-5 tiny)."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraphBackend
    from sglang.srt.speculative.eagle_worker import target_verify_spec

    model = "builtin:tiny-glm-moe-dsa-mtp"  # (the V3.2 tiny model's verify graph differs only in not handing top-k)
    prompts = [[(11 * i + 7 * j) % 900 + 5 for j in range(30 + 7 * i)] for i in range(3)]
    # "mixed" drafts verify at 1, 2 and 5 tokens generated (accepting 0, 2, 2 drafts): 6 tokens end
    # inside the last accepted run, as 10 did one verify later
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    kw = dict(nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
    ref = _engine(False, model, **kw).generate(input_ids=prompts, sampling_params=params)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    eager = _engine(True, model, **kw)
    eager.scheduler.tp_worker.draft_override = forced_drafts(targets, "mixed")
    eager_out = eager.generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, model, cuda_graph_max_bs=4, max_running_requests=4, **kw)
    worker = spec.scheduler.tp_worker
    worker.draft_override = forced_drafts(targets, "mixed")
    tr = worker.target.model_runner
    vspec = target_verify_spec(tr.model_config, worker.num_tokens_per_req)
    assert "topk_indices" in vspec.extra_outputs
    runner = CudaGraphRunner(tr, EagerGraphBackend(), specs=(vspec,))
    assert runner.max_bs == 4 * 4  # rows: up to 4 requests x 4 verified tokens
    tr.cuda_graph_runner = runner
    replays = []
    replay = runner.replay
    runner.replay = lambda fb: (replays.append(fb.batch_size), replay(fb))[1]
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager_out]
    assert worker.avg_accept_length == eager.scheduler.tp_worker.avg_accept_length > 1.0
    assert 12 in replays and set(replays) <= {4, 8, 12}  # 3, 2, 1 requests x 4 rows
    _whole(spec)


def test_retraction_under_a_small_pool():
    prompts = _prompts(5)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    ref = _engine(False, page_size=4).generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, max_total_tokens=128, page_size=4)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    spec.scheduler.tp_worker.draft_override = forced_drafts(targets, "right")
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    _whole(spec)


def _recording(drafts_seen: list):
    """A draft_override that keeps the drafts it is shown (and verifies them unchanged)."""
    def override(reqs, drafts, kv_lens):
        drafts_seen.append(drafts.cpu().clone())
        return drafts
    return override


def test_token_map_drafts_hot_tokens_only_and_output_equals_plain(tmp_path):
    """FR-Spec (--speculative-token-map): the draft's head over the hot tokens. A map that holds
    every token the full head drafted gives the same drafts; a map of other tokens drafts only
    those; plain decoding's output either way."""
    prompts = _prompts(3)
    params = [{"temperature": 0, "max_new_tokens": 8 + 4 * i, "ignore_eos": True} for i in range(3)]
    ref = [_key(o) for o in _engine(False).generate(input_ids=prompts, sampling_params=params,
                                                    return_logprob=True)]
    full_drafts: list = []
    spec = _engine(True)
    spec.scheduler.tp_worker.draft_override = _recording(full_drafts)
    assert [_key(o) for o in spec.generate(input_ids=prompts, sampling_params=params, return_logprob=True)] == ref
    seen = sorted({int(t) for d in full_drafts for t in d.flatten()})
    vocab = spec.scheduler.tp_worker.vocab_size
    spec.shutdown()
    cold = [t for t in range(vocab) if t not in seen]
    for name, hot in (("superset", seen + cold[::7]), ("disjoint", cold[: max(8, vocab // 16)])):
        path = tmp_path / f"{name}.pt"
        torch.save(torch.tensor(hot[::-1]), path)  # any order: the map's, not the vocabulary's
        drafts: list = []
        eng = _engine(True, speculative_token_map=str(path))
        worker = eng.scheduler.tp_worker
        assert worker.draft_runner.model.lm_head.weight.shape[0] == len(hot)
        worker.draft_override = _recording(drafts)
        assert [_key(o) for o in eng.generate(input_ids=prompts, sampling_params=params,
                                              return_logprob=True)] == ref, name
        if name == "superset":  # the full head's argmax is hot: the same drafts, step by step
            assert len(drafts) == len(full_drafts)
            assert all(torch.equal(a, b) for a, b in zip(drafts, full_drafts))
        else:
            assert {int(t) for d in drafts for t in d.flatten()} <= set(hot)
        _whole(eng)
        eng.shutdown()


@pytest.mark.parametrize("content,match", [
    ("[1, 2, 2]", "repeats token ids"),
    ("[]", "holds no token ids"),
    ("[3, 99999999]", "outside the vocabulary"),
    ("not a list", "could not read token ids"),
])
def test_bad_token_map_names_the_flag(tmp_path, content, match):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ServerArgsError, match=match) as e:
        _engine(True, speculative_token_map=str(path))
    assert e.value.flag == "speculative_token_map"
    with pytest.raises(ServerArgsError, match="no such file") as e:
        ServerArgs.from_kwargs(model_path=MODEL, speculative_algorithm="EAGLE",
                               speculative_token_map=str(tmp_path / "missing.pt")).resolve()
    assert e.value.flag == "speculative_token_map"
    with pytest.raises(ServerArgsError, match="needs --speculative-algorithm"):
        ServerArgs.from_kwargs(model_path=MODEL, speculative_token_map=str(path)).resolve()


@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_eagle_topk=2), "speculative_eagle_topk"),
    (dict(speculative_num_draft_tokens=7), "speculative_num_draft_tokens"),
    (dict(enable_mixed_chunk=True), "enable_mixed_chunk"),
])
def test_bad_speculative_flags(kw, flag):
    with pytest.raises(ServerArgsError) as e:
        ServerArgs.from_kwargs(model_path=MODEL, speculative_algorithm="EAGLE", **kw).resolve()
    assert e.value.flag == flag
    with pytest.raises(ServerArgsError, match="needs --speculative-algorithm"):
        ServerArgs.from_kwargs(model_path=MODEL, speculative_num_draft_tokens=4).resolve()


def _hidden(o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt block [prompt_len, H], one row per generated token fed back [completion - 1, H])."""
    hs = o["meta_info"]["hidden_states"]
    return torch.tensor(hs[0]), torch.tensor(hs[1:]).reshape(len(hs) - 1, -1)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_hidden_states_equal_plain_decoding(overlap):
    """return_hidden_states under EAGLE: the prompt's block and one target last-layer row per token
    fed back, exactly as plain decoding returns (accepted verify rows are the positions plain
    decoding computes; rows past a request's end are dropped). Random, right (several rows accepted
    per step, max_new_tokens ending inside a run), wrong and mixed drafts; a grammar request runs
    alone (its batch verifies one row at a time)."""
    prompts = _prompts(4)
    params = [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 7, "regex": "(yes|no)[a-d]{2,6}"}]
    # float32: plain decode and the decode-shaped verify rows may round differently in bf16 on GPUs
    kw = dict(enable_return_hidden_states=True, disable_overlap_schedule=not overlap, dtype="float32")
    plain, spec = _engine(False, **kw), _engine(True, **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-3, rtol=2e-3)  # TF32 matmuls
    worker = spec.scheduler.tp_worker
    batches = [(prompts[:3], params[:3]), ([prompts[3]], [params[3]])]
    refs = [plain.generate(input_ids=p, sampling_params=sp, return_hidden_states=True) for p, sp in batches]
    targets = {tuple(p): r["output_ids"] for (ps, _), rs in zip(batches, refs) for p, r in zip(ps, rs)}
    for mode in (None, "right", "wrong", "mixed"):
        worker.draft_override = None if mode is None else forced_drafts(targets, mode)
        for (ps, sp), ref in zip(batches, refs):
            assert spec.flush_cache()
            worker.num_verify_steps = worker.num_accepted_drafts = 0
            outs = spec.generate(input_ids=ps, sampling_params=sp, return_hidden_states=True)
            for i, (o, r) in enumerate(zip(outs, ref)):
                assert o["output_ids"] == r["output_ids"], (mode, i)
                (p_ours, g_ours), (p_ref, g_ref) = _hidden(o), _hidden(r)
                h = p_ref.shape[1]
                assert p_ours.shape == p_ref.shape == (len(ps[i]), h), (mode, i)
                assert g_ours.shape == g_ref.shape == (len(r["output_ids"]) - 1, h), (mode, i)
                torch.testing.assert_close(p_ours, p_ref, **tol)
                torch.testing.assert_close(g_ours, g_ref, **tol, msg=lambda m: f"{mode} {i}: {m}")
            if mode == "right" and len(ps) > 1:
                assert worker.avg_accept_length > 2.0  # several rows per verify were returned
            _whole(spec)


def test_checkpoint_without_mtp_layer_names_the_flags():
    with pytest.raises(ServerArgsError) as e:
        _engine(True, "builtin:tiny-deepseek-v32")
    assert e.value.flag == "speculative_algorithm" and "--speculative-draft-model-path" in str(e.value)


def test_server_streams_equal_plain_and_report_accept_length():
    """Through the HTTP server (official openai client): concurrent streamed completions with
    speculation equal plain decoding; an aborted stream frees its slots; accept length is in
    meta_info, /get_server_info and /metrics (sglang:spec_accept_length)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import requests

    from sglang.srt.testing.server import ServerProcess

    prompts = [f"Request {i}: " + "alpha beta " * (i + 2) for i in range(8)]
    plain = _engine(False)
    ref = [plain.generate(p, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})["text"] for p in prompts]
    with ServerProcess(MODEL, *EXACT_FLAGS, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                       "--max-total-tokens", "4096", "--enable-metrics", "--random-seed", "0") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")

        def stream(p: str) -> str:
            chunks = client.completions.create(model="default", prompt=p, max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(stream, prompts)) == ref
        body = {"text": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
        meta = requests.post(server.base_url + "/generate", json=body, timeout=120).json()["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] >= 1.0
        with client.completions.create(model="default", prompt="count:", max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}) as s:
            for i, _ in enumerate(s):
                if i == 3:
                    break  # the client goes away mid-stream
        st = server.wait_idle()
        assert st["kv_leak"] is None and st["kv_protected_tokens"] == 0
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
        assert st["avg_spec_accept_length"] >= 1.0
        assert "sglang:spec_accept_length" in requests.get(server.base_url + "/metrics", timeout=30).text


def test_server_hidden_states_as_upstreams_eagle_suite_asserts():
    """Upstream's TestOpenAIServerWithEAGLEAndHiddenStatesEnabled through the official client:
    completions (one prompt, a list) and chat, streamed and not, carry `hidden_states` as one 1-D
    row (the last generated token's), none without the flag; here the row also equals plain
    decoding's (the in-process plain engine on the same prompt)."""
    import numpy as np
    import openai

    from sglang.srt.testing.server import ServerProcess

    prompt, sp = "The capital of France is", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    plain = _engine(False, enable_return_hidden_states=True, dtype="float32")
    expect = plain.generate(prompt, sp, return_hidden_states=True)["meta_info"]["hidden_states"][-1]
    tol = dict(atol=1e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-3, rtol=2e-3)
    with ServerProcess(MODEL, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--device", DEVICE,
                       "--dtype", "float32", "--max-total-tokens", "4096", "--enable-return-hidden-states",
                       "--random-seed", "0") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="default", max_tokens=8, temperature=0)
        for want in (False, True):
            extra = {"return_hidden_states": want, "ignore_eos": True}
            for p in (prompt, [prompt, prompt]):
                r = client.completions.create(prompt=p, extra_body=extra, **kw)
                assert r.usage.completion_tokens == 8 * (2 if isinstance(p, list) else 1)
                for c in r.choices:
                    hs = c.model_extra.get("hidden_states")
                    if not want:
                        assert hs is None
                        continue
                    assert np.asarray(hs).ndim == 1
                    np.testing.assert_allclose(hs, expect, **tol)
            found = [c.hidden_states for ch in client.completions.create(
                prompt=[prompt], stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw)
                for c in ch.choices if getattr(c, "hidden_states", None) is not None]
            assert len(found) == (1 if want else 0)
            if want:
                assert np.asarray(found[0]).ndim == 1
                np.testing.assert_allclose(found[0], expect, **tol)
            msgs = [{"role": "user", "content": "What is the capital of France?"}]
            r = client.chat.completions.create(messages=msgs, extra_body=extra, **kw)
            hs = r.choices[0].model_extra.get("hidden_states")
            assert (hs is None) if not want else np.asarray(hs).ndim == 1
            found = [c.delta.hidden_states for ch in client.chat.completions.create(
                messages=msgs, stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw)
                for c in ch.choices if hasattr(c.delta, "hidden_states")]
            assert len(found) == (1 if want else 0)
            if want:
                assert np.asarray(found[0]).ndim == 1 and found[0] == pytest.approx(hs, abs=1e-5)
        st = server.wait_idle()
        assert st["kv_leak"] is None


def test_load_64_streams_with_aborts_and_retraction():
    """64 concurrent speculative streams, every fourth dropped by its client mid-stream, over a KV
    pool too small for all of them (retraction): no errors, no leak, every completed output equal
    to plain decoding and every dropped one a prefix of it."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from sglang.srt.testing.server import ServerProcess

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randrange(8, 24))] for _ in range(64)]
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    # page size 4 on every device: with CUDA's default 64 the 640-token pool is 10 pages, one per
    # request, and nothing grows past its page (no retraction to test)
    ref = [o["output_ids"] for o in _engine(False, page_size=4).generate(input_ids=prompts, sampling_params=sp)]
    with ServerProcess(MODEL, *EXACT_FLAGS, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                       "--max-total-tokens", "640", "--page-size", "4", "--random-seed", "0") as server:
        errors, lock = [], threading.Lock()

        def run(i: int):
            body = {"input_ids": prompts[i], "sampling_params": sp, "stream": True}
            got = []
            try:
                with requests.post(server.base_url + "/generate", json=body, stream=True, timeout=600) as r:
                    assert r.status_code == 200, r.text
                    for line in r.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        got = json.loads(line[6:])["output_ids"]
                        if i % 4 == 0 and len(got) >= 3:
                            break  # this client goes away
                if i % 4 == 0:
                    assert got == ref[i][:len(got)], i
                else:
                    assert got == ref[i], i
            except Exception as e:  # reported below
                with lock:
                    errors.append((i, repr(e)))

        with ThreadPoolExecutor(64) as pool:
            list(pool.map(run, range(64)))
        assert not errors, errors[:3]
        st = server.wait_idle(timeout=120)
        assert st["kv_leak"] is None and st["kv_protected_tokens"] == 0
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
        assert "retracted" in server.log()  # the pool was too small: requests went back to the queue


def test_cp2_speculative_equals_plain_and_draft_kv_is_sharded(builtin_path):
    """Prefill CP (2 ranks, gloo) with speculation: the same greedy tokens as one rank without it,
    for a batch and cache-hit followups, both split modes, page sizes 1 and 64, IndexCache sharing
    on (GLM-5 tiny) and off (V3.2 tiny). SGLANG_CP_DRAFT_SHARED_KV_DEBUG=1 shows the draft KV is
    sharded like the target's: each prefill's draft extend takes the rank's own hidden rows (no
    gather), writes only the rank's physical pages of its own draft pool, a pool of 1/cp."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (37, 70, 5, 130)]
    followups = [prompts[1] + [7], prompts[3][:64] + [9, 11]]
    env = {"SGLANG_CP_DRAFT_SHARED_KV_DEBUG": "1"}
    cases = []
    for model, mode, ps in (("tiny-glm-moe-dsa-mtp", "in-seq-split", 1), ("tiny-deepseek-v32-mtp", "round-robin-split", 64)):
        sa = dict(model_path=builtin_path(model), enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode=mode,
                  page_size=ps, chunked_prefill_size=-1, speculative_algorithm="EAGLE", speculative_num_steps=3)
        cases.append(Case(f"{model}/{mode}/p{ps}", sa, prompts, 8, followups=followups, env=env))
    got = run_multi_rank(cases, 2)
    for case, res in zip(cases, got):
        plain = {k: v for k, v in case.server_args.items() if k not in (
            "enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode", "speculative_algorithm",
            "speculative_num_steps")}
        ref = run_case(Case(case.name, plain, case.prompts, case.max_new_tokens, case.followups), 1)
        for rid in ref:
            if not rid.startswith("_"):
                assert res[rid]["ids"] == ref[rid]["ids"], (case.name, rid)
        assert res["_stats"]["kv_leak"] is None, res["_stats"]
        draft = res["_draft"]
        assert draft["pool_slots"] * 2 == res["_stats"]["capacity"]
        ps = case.server_args["page_size"]
        rank_pages = draft["pool_slots"] // ps
        prefills = [r for r in draft["debug"] if r["hidden_local_input"]]
        assert len(prefills) >= 2 and all(r["rank"] == 0 for r in draft["debug"])
        for r in prefills:
            assert r["hidden_rows"] == r["local_rows"]  # the target's local rows, never gathered
            assert all(0 <= p <= rank_pages for p in r["physical_pages"]), (case.name, r)  # own pool
        # the first batch's rows are split: rank 0 computes fewer than all of them
        assert prefills[0]["valid_rows"] < sum(len(p) for p in prompts)


def test_cp2_speculative_returns_hidden_states_as_one_rank(builtin_path):
    """return_hidden_states under prefill CP with speculation: the prompt's rows are gathered from
    the ranks (the draft then extends from the gathered rows) and each accepted verify row comes
    back: the same tokens and hidden states as one rank without CP (plain decoding's rows)."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (21, 40)]
    sa = dict(model_path=builtin_path("tiny-deepseek-v32-mtp"), enable_nsa_prefill_context_parallel=True,
              nsa_prefill_cp_mode="in-seq-split", page_size=1, chunked_prefill_size=-1, dtype="float32",
              speculative_algorithm="EAGLE", speculative_num_steps=3, enable_return_hidden_states=True)
    case = Case("hidden", sa, prompts, 6, return_hidden_states=True)
    got = run_multi_rank([case], 2)[0]
    one = {k: v for k, v in sa.items() if k not in ("enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode",
                                                    "speculative_algorithm", "speculative_num_steps")}
    ref = run_case(Case("hidden", one, prompts, 6, return_hidden_states=True), 1)
    for rid in ("p0", "p1"):
        assert got[rid]["ids"] == ref[rid]["ids"], rid
        ours, theirs = got[rid]["hidden"], ref[rid]["hidden"]
        assert len(ours) == len(theirs) == len(ref[rid]["ids"]), rid  # the prompt block + a row per fed token
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert got["_stats"]["kv_leak"] is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_cp2_speculative_ranks_keep_the_same_drafts(builtin_path, page_size):
    """Under prefill CP every rank must propose the same drafts: the ranks' schedulers accept from
    them, and a request accepted on one rank only parts their batches (gloo: "Received data size
    doesn't match expected size", the server dies). The draft's logits came from each rank's own
    rows, garbage for requests whose last token another rank holds, which a batch of 16 short
    prompts hit within 16 tokens. Now they are the narrow gather's, as the target's."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (16,), generator=g)]
    sa = dict(model_path=builtin_path("tiny-deepseek-v32-mtp"), enable_nsa_prefill_context_parallel=True,
              nsa_prefill_cp_mode="in-seq-split", page_size=page_size, speculative_algorithm="EAGLE",
              speculative_num_steps=3)
    got = run_multi_rank([Case("drafts", sa, prompts, 16)], 2)[0]
    assert got["_draft"]["state_equal_across_ranks"]
    one = {k: v for k, v in sa.items() if k not in ("enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode")}
    ref = run_case(Case("drafts", one, prompts, 16), 1)  # one rank, same speculation
    for rid in ref:
        if not rid.startswith("_"):
            assert got[rid]["ids"] == ref[rid]["ids"], rid
    assert got["_draft"]["accept_length"] == ref["_draft"]["accept_length"]  # the same drafts accepted
    assert got["_stats"]["kv_leak"] is None


def test_cp2_speculative_with_prompt_logprobs_equals_one_rank(builtin_path):
    """Input logprobs (an OpenAI `echo` + `logprobs` request) under prefill CP with speculation: the
    target gathers every row for the prompt's logprobs while the draft extends from the rank's own
    rows (it crashed the scheduler: "CP draft extend: 6 local hidden rows for a layout of 3").
    Tokens and logprobs equal one rank without CP or speculation."""
    from sglang.srt.testing.multi_rank import Case, run_case, run_multi_rank

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (6, 33)]
    sa = dict(model_path=builtin_path("tiny-deepseek-v32-mtp"), enable_nsa_prefill_context_parallel=True,
              nsa_prefill_cp_mode="in-seq-split", page_size=1, chunked_prefill_size=-1, dtype="float32",
              speculative_algorithm="EAGLE", speculative_num_steps=3)
    case = Case("echo", sa, prompts, 6, followups=[prompts[1] + [5]], return_logprob=True, logprob_start_len=0)
    got = run_multi_rank([case], 2)[0]
    one = {k: v for k, v in sa.items() if k not in ("enable_nsa_prefill_context_parallel", "nsa_prefill_cp_mode",
                                                    "speculative_algorithm", "speculative_num_steps")}
    ref = run_case(Case("echo", one, prompts, 6, followups=case.followups, return_logprob=True,
                        logprob_start_len=0), 1)
    for rid in ref:
        if rid.startswith("_"):
            continue
        assert got[rid]["ids"] == ref[rid]["ids"], rid
        ours, theirs = got[rid]["input_logprobs"], ref[rid]["input_logprobs"]
        assert ours is not None and len(ours) == len(theirs), rid
        torch.testing.assert_close(torch.tensor([x for x in ours if x is not None]),
                                   torch.tensor([x for x in theirs if x is not None]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(got[rid]["logprobs"]), torch.tensor(ref[rid]["logprobs"]),
                                   atol=1e-4, rtol=1e-4)
    assert got["_stats"]["kv_leak"] is None


def _chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic of observed counts against exact probabilities (cells expecting fewer
    than 5 pooled into one); returns (statistic, degrees of freedom)."""
    small_obs = small_exp = 0.0
    stat, cells = 0.0, 0
    for cell, p in probs.items():
        exp, obs = p * n, counts.get(cell, 0)
        if exp < 5:
            small_obs, small_exp = small_obs + obs, small_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        cells += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
        cells += 1
    assert sum(counts.values()) == n and set(counts) <= set(probs), "a sample outside the support"
    return stat, cells - 1


# chi-square critical values at p = 1e-4 (df 1..16): a correct sampler fails this 1 time in 10^4
_CHI2_CRIT = [15.1, 18.4, 21.1, 23.5, 25.7, 27.9, 29.9, 31.8, 33.7, 35.6, 37.4, 39.1, 40.8, 42.5, 44.3, 45.9]


def test_sampling_keeps_the_target_distribution():
    """Speculative sampling keeps the target's distribution (the issue's tiny-vocabulary check):
    top_k 4 at temperature 0.1 makes each step a 4-token distribution; 800 unseeded samples of the
    first two tokens (drafts forced to the greedy path, so drafts are accepted and rejected) are
    tested against the exact joint p(t1) p(t2 | t1) computed from the target's own logprobs.
    Accepting a draft exactly when it equals the target's draw is rejection sampling for a
    deterministic draft: accept d with probability p(d), else draw from p without d."""
    prompt = [(13 * j) % 900 + 5 for j in range(12)]
    temp, k, n = 0.1, 4, 800
    plain = _engine(False)

    def step_probs(ids: list[int]) -> dict[int, float]:
        o = plain.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           return_logprob=True, top_logprobs_num=k)
        top = o["meta_info"]["output_top_logprobs"][0]
        w = torch.softmax(torch.tensor([lp for lp, _, _ in top]) / temp, dim=0).tolist()
        return {tid: p for (_, tid, _), p in zip(top, w)}

    p1 = step_probs(prompt)
    joint = {(a, b): pa * pb for a, pa in p1.items() for b, pb in step_probs(prompt + [a]).items()}
    greedy = plain.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 4})["output_ids"]

    spec = _engine(True, max_total_tokens=16384, max_running_requests=256)
    worker = spec.scheduler.tp_worker
    worker.draft_override = forced_drafts({tuple(prompt): greedy}, "right")
    params = {"temperature": temp, "top_k": k, "max_new_tokens": 2, "ignore_eos": True}
    outs = spec.generate(input_ids=[prompt] * n, sampling_params=params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o["output_ids"])] = counts.get(tuple(o["output_ids"]), 0) + 1
    stat, df = _chi_square(counts, joint, n)
    assert stat < _CHI2_CRIT[df - 1], (stat, df, counts, joint)
    assert worker.num_accepted_drafts > 0.2 * n  # the accept path ran (p(greedy) >= 1/4 per step)
    # the statistic has power: greedy-biased samples (drafts always accepted) fail it
    biased = {(greedy[0], greedy[1]): n}
    assert _chi_square(biased, joint, n)[0] > _CHI2_CRIT[df - 1]
    _whole(spec)
