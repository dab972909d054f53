"""SamplingParams validation, SamplingBatchInfo (penalties, bias, min_new_tokens, seeds) and the
Sampler (greedy, filters, distribution, seeded determinism, logprobs). CPU, fast."""

from __future__ import annotations


import pytest


import torch

from sglang.srt.layers.sampler import Sampler, SamplerOutput, filter_mask
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams, choice_seed

V = 50
NEG_INF = float("-inf")


def sp(**kw) -> SamplingParams:
    p = SamplingParams(**kw)
    p.normalize(None)
    p.verify(V)
    return p


def info_for(params: list[SamplingParams], vocab: int = V, **kw) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_params(params, vocab, "cpu", **kw)


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> SamplerOutput:
    return Sampler()(logits.clone(), info_for(params, logits.shape[-1], **kw))


# -- greedy ---------------------------------------------------------------------------------------
def tied_logits(bs: int = 6, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # Small integer values: many exact ties, including at the maximum.
    return torch.randint(0, 4, (bs, vocab), generator=g).float()


def test_greedy_equals_argmax_with_ties():
    logits = tied_logits()
    out = sample(logits, [sp(temperature=0.0) for _ in range(logits.shape[0])])
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64
    # No sampling info at all is greedy too.
    assert torch.equal(Sampler()(logits.clone(), None).next_token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = tied_logits()
    out = sample(logits, [sp(temperature=0.7, top_k=1) for _ in range(logits.shape[0])])
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_greedy_rows_in_mixed_batch():
    logits = tied_logits(8)
    params = [sp(temperature=0.0) if i % 2 else sp(temperature=1.3, top_p=0.7) for i in range(8)]
    info = info_for(params)
    assert not info.is_all_greedy and info.need_top_p_sampling
    out = Sampler()(logits.clone(), info)
    assert torch.equal(out.next_token_ids[1::2], logits.argmax(-1)[1::2])


def test_filter_flags_only_for_sampled_rows():
    info = info_for([sp(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2), sp()])
    assert not (info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling)
    assert info.top_ks.tolist() == [1, V] and info.temperatures.view(-1).tolist() == [1.0, 1.0]


# -- filters vs a per-row reference ---------------------------------------------------------------
def reference_keep(probs_row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Joint filters on the unfiltered distribution; ties ordered by token id."""
    order = sorted(range(len(probs_row)), key=lambda t: (-probs_row[t], t))
    k = len(order) if top_k < 0 else top_k
    keep, mass = set(), 0.0
    for rank, t in enumerate(order):
        in_k = rank < k
        in_p = top_p >= 1.0 or mass < top_p
        mass += probs_row[t]
        if (in_k and in_p) or rank == 0:
            keep.add(t)
    max_p = probs_row[order[0]]
    return {t for t in keep if probs_row[t] >= max_p * min_p}


FILTER_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0), (0.5, -1, 0.8, 0.0), (1.5, -1, 1.0, 0.1), (1.0, 10, 0.5, 0.05),
    (0.8, 1000, 0.95, 0.0), (1.0, 3, 0.3, 0.5), (2.0, -1, 0.05, 0.0), (1.0, -1, 1.0, 0.0),
]


def test_filter_masks_match_reference():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(FILTER_CASES), V, generator=g) * 3
    params = [sp(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in FILTER_CASES]
    info = info_for(params)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    keep = filter_mask(probs, info)
    for i, (_, k, p, m) in enumerate(FILTER_CASES):
        got = set(torch.nonzero(keep[i]).view(-1).tolist())
        assert got == reference_keep(probs[i].double().tolist(), k, p, m), FILTER_CASES[i]


def test_sampled_tokens_stay_inside_mask():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(FILTER_CASES), V, generator=g) * 3
    params = [sp(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in FILTER_CASES]
    info = info_for(params)
    keep = filter_mask(torch.softmax(logits / info.temperatures, -1), info)
    torch.manual_seed(0)
    for _ in range(50):
        ids = Sampler()(logits.clone(), info_for(params)).next_token_ids
        assert keep[torch.arange(len(params)), ids].all()


# -- distribution -----------------------------------------------------------------------------------
N_DRAWS = 20000
# Max |empirical - expected| over tokens: binomial std <= sqrt(0.25 / 20000) = 0.0035, 0.012 is
# ~3.4 sigma. Chi-square over the kept tokens (<= 7 cells, df <= 6): 25 is p ~ 3e-4. The seed is
# fixed, so the test is deterministic; both bounds fail if the filters or temperature are ignored.
DIST_TOL = 0.012
CHI2_MAX = 25.0
DIST_ROW = [2.0, 1.5, 1.4, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, NEG_INF, 0.2]
DIST_PARAMS = dict(temperature=0.7, top_k=6, top_p=0.85, min_p=0.1)


def expected_filtered(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(logits_row.double() / p.temperature, -1)
    keep = reference_keep(probs.tolist(), p.top_k, p.top_p, p.min_p)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[list(keep)] = True
    probs = probs * mask
    return probs / probs.sum()


def chi2(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    exp = expected_p * counts.sum()
    live = exp > 0
    return (((counts[live] - exp[live]) ** 2) / exp[live]).sum().item()


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_filtered_softmax(seeded: bool):
    row = torch.tensor(DIST_ROW)
    vocab = row.numel()
    params = [SamplingParams(**DIST_PARAMS, sampling_seed=(i if seeded else None)) for i in range(N_DRAWS)]
    torch.manual_seed(0)
    out = sample(row.expand(N_DRAWS, vocab).contiguous(), params)
    counts = torch.bincount(out.next_token_ids, minlength=vocab).double()
    exp = expected_filtered(row, params[0])
    assert (counts / N_DRAWS - exp).abs().max().item() < DIST_TOL
    assert chi2(counts, exp) < CHI2_MAX
    assert counts[exp == 0].sum().item() == 0  # filtered tokens are never drawn
    # The bounds are tight enough to notice a missing filter or temperature.
    unfiltered = torch.softmax(row.double() / DIST_PARAMS["temperature"], -1)
    t1 = expected_filtered(row, SamplingParams(**{**DIST_PARAMS, "temperature": 1.0}))
    assert (counts / N_DRAWS - unfiltered).abs().max().item() > DIST_TOL
    assert chi2(counts, t1) > CHI2_MAX


# -- seeded determinism -----------------------------------------------------------------------------
def test_seeded_rows_independent_of_batch_composition():
    g = torch.Generator().manual_seed(4)
    target = torch.randn(V, generator=g) * 2
    target_p = sp(temperature=1.0, sampling_seed=1234)  # no filters: must not depend on mates'
    others = torch.randn(6, V, generator=g) * 2
    mates = [sp(temperature=0.0), sp(top_k=3, top_p=0.6), sp(min_p=0.3, sampling_seed=7), sp(),
             sp(temperature=1.7, sampling_seed=99), sp(top_p=0.2, frequency_penalty=0.5)]

    results = []
    for step in range(20):
        ids = set()
        for layout in range(4):
            torch.manual_seed(1000 + layout)  # different global RNG state every time
            if layout == 0:
                batch, params, pos = target.view(1, -1), [target_p], 0
            else:
                pos = layout + 1
                rows = [others[(j + layout) % 6] for j in range(6)]
                ps = [mates[(j + layout) % 6] for j in range(6)]
                rows.insert(pos, target)
                ps.insert(pos, target_p)
                batch, params = torch.stack(rows), ps
            out = sample(batch, params, seeds_step=[step] * len(params))
            ids.add(out.next_token_ids[pos].item())
        assert len(ids) == 1, f"step {step}: {ids}"
        results.append(ids.pop())
    assert len(set(results)) > 1  # the step actually changes the draw


def test_seeded_filtered_row_deterministic_and_step_from_output_len():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)
    params = [sp(top_p=0.7, top_k=20, sampling_seed=5), sp(), sp(sampling_seed=6)]
    a = sample(logits, params, output_ids=[[1, 2, 3], [4], []]).next_token_ids
    b = sample(logits, params, seeds_step=[3, 9, 0]).next_token_ids
    assert a[0] == b[0] and a[2] == b[2]
    # Different seeds differ somewhere across steps.
    p1, p2 = sp(sampling_seed=1), sp(sampling_seed=2)
    draws = [sample(logits[:1].repeat(2, 1), [p1, p2], seeds_step=[s, s]).next_token_ids.tolist()
             for s in range(20)]
    assert any(x != y for x, y in draws)


def test_cumulate_output_tokens_matches_rebuild():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, V, generator=g)
    params = [sp(sampling_seed=3, frequency_penalty=0.7, repetition_penalty=1.3, min_new_tokens=2),
              sp(presence_penalty=-0.4, sampling_seed=8)]
    outs = [[5, 5], [7]]
    info = info_for(params, output_ids=outs, eos_token_ids={0})
    new = torch.tensor([9, 7])
    info.cumulate_output_tokens(new)
    rebuilt = info_for(params, output_ids=[o + [int(t)] for o, t in zip(outs, new)], eos_token_ids={0})
    a, b = Sampler()(logits.clone(), info), Sampler()(logits.clone(), rebuilt)
    assert torch.equal(a.next_token_ids, b.next_token_ids)
    assert torch.equal(info.output_token_counts, rebuilt.output_token_counts)
    assert torch.equal(info.repetition_mask, rebuilt.repetition_mask)
    assert info.seeds_step == rebuilt.seeds_step == [3, 2]


# -- penalties / bias / min_new_tokens --------------------------------------------------------------
def reference_penalties(row: list[float], seen: list[int], freq: float, pres: float, rep: float) -> list[float]:
    out = list(row)
    for t in set(seen):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= freq * seen.count(t) + pres
    return out


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, V, generator=g) * 2
    cfg = [(0.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 1.5), (-0.3, 0.4, 0.7)]
    outs = [[1, 1, 2, 40], [3, 3, 3], [4, 5, 4, 0], [6, 7, 6, 6, 49]]
    info = info_for([sp(frequency_penalty=f, presence_penalty=p, repetition_penalty=r) for f, p, r in cfg],
                    output_ids=outs)
    got = info.apply_logits_bias(logits.clone())
    for i, (f, p, r) in enumerate(cfg):
        ref = torch.tensor(reference_penalties(logits[i].tolist(), outs[i], f, p, r))
        torch.testing.assert_close(got[i], ref, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_with_prompt_ids():
    logits = torch.full((1, V), 1.0)
    info = info_for([sp(repetition_penalty=2.0)], output_ids=[[3]], prompt_ids=[[10, 11]])
    got = info.apply_logits_bias(logits.clone())[0]
    assert got[[3, 10, 11]].tolist() == [0.5, 0.5, 0.5] and got[4].item() == 1.0


def test_no_penalties_no_state():
    info = info_for([sp(), sp(temperature=0.0)], output_ids=[[1], [2]])
    assert not info.has_penalties and info.logit_bias_rows is None and info.min_new_rows is None
    logits = torch.randn(2, V)
    assert torch.equal(info.apply_logits_bias(logits.clone()), logits)


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, 0] = 10.0  # EOS is the argmax
    logits[:, 7] = 9.0  # a stop_token_id, second best
    logits[:, 3] = 8.0
    params = [sp(temperature=0.0, min_new_tokens=3, stop_token_ids=[7]), sp(temperature=0.0, stop_token_ids=[7])]
    info = info_for(params, output_ids=[[1, 2], [1, 2]], eos_token_ids={0})
    out = Sampler()(logits.clone(), info)
    assert out.next_token_ids.tolist() == [3, 0]  # row 0 banned EOS + stop id; row 1 has no minimum
    info.cumulate_output_tokens(out.next_token_ids)  # 3 tokens out: ban lifted
    assert Sampler()(logits.clone(), info).next_token_ids.tolist() == [0, 0]


def test_logit_bias_sparse_add():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, V, generator=g)
    params = [sp(logit_bias={"5": 2.5, 9: -1.0}), sp(), sp(logit_bias={"0": 100.0}, temperature=0.8)]
    info = info_for(params)
    assert info.logit_bias.shape == (3, V) and info.logit_bias._nnz() == 3
    got = info.apply_logits_bias(logits.clone())
    ref = logits.clone()
    ref[0, 5] += 2.5
    ref[0, 9] -= 1.0
    ref[2, 0] += 100.0
    assert torch.equal(got, ref)
    assert Sampler()(logits.clone(), info_for(params)).next_token_ids[2].item() == 0


def test_sampler_applies_bias_once():
    logits = torch.zeros(1, V)
    info = info_for([sp(temperature=0.0, logit_bias={4: 1.0}, frequency_penalty=0.5)], output_ids=[[4]])
    info.apply_logits_bias(logits)  # caller applied it already: the Sampler must not re-apply
    out = Sampler()(logits, info, return_logprob=True)
    assert logits[0, 4].item() == 0.5 and out.next_token_ids.item() == 4


# -- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_penalised_logits():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, V, generator=g) * 2
    params = [sp(temperature=0.0), sp(temperature=0.5, top_p=0.5), sp(logit_bias={3: 1.5}, top_k=4),
              sp(frequency_penalty=1.0, sampling_seed=1)]
    outs = [[], [], [], [2, 2]]
    nums = [0, 3, 5, 1]
    biased = info_for(params, output_ids=outs).apply_logits_bias(logits.clone())
    out = Sampler()(logits.clone(), info_for(params, output_ids=outs), return_logprob=True, top_logprobs_nums=nums)
    ref = torch.log_softmax(biased, -1)
    torch.testing.assert_close(out.next_token_logprobs, ref.gather(1, out.next_token_ids.view(-1, 1)).view(-1))
    assert out.next_token_logprobs.dtype == torch.float32
    for i, n in enumerate(nums):
        vals, ids = out.top_logprobs.rows()[i]
        rv, ri = ref[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        assert ids == ri.tolist() and len(vals) == n
        torch.testing.assert_close(torch.tensor(vals), rv)
    plain = Sampler()(logits.clone(), info_for(params, output_ids=outs))
    assert plain.next_token_logprobs is None and plain.top_logprobs is None


# -- NaN / inf safety ------------------------------------------------------------------------------
def test_nonfinite_rows():
    logits = torch.full((5, V), NEG_INF)
    logits[0, 17] = 0.3  # only one finite token
    logits[1, 4] = float("inf")  # +inf dominates
    logits[1, 5] = 1.0
    logits[2] = torch.randn(V)
    logits[2, :10] = float("nan")  # NaNs are never sampled
    logits[3, 21] = -1e30
    logits[4, 8] = 5.0  # tiny temperature: logits / T overflows
    logits[4, 9] = 4.0
    params = [sp(top_p=0.5, top_k=3, min_p=0.2), sp(), sp(top_p=0.9), sp(temperature=2.0),
              sp(temperature=2e-6, sampling_seed=3)]
    torch.manual_seed(0)
    for _ in range(20):
        ids = sample(logits, params).next_token_ids.tolist()
        assert ids[0] == 17 and ids[1] == 4 and ids[2] >= 10 and ids[3] == 21 and ids[4] == 8
    # A row with no finite logit at all falls back to argmax instead of crashing.
    dead = torch.full((1, V), NEG_INF)
    assert torch.equal(sample(dead, [sp()]).next_token_ids, dead.argmax(-1))


# -- SamplingParams ----------------------------------------------------------------------------------
BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", "0.7"), ("temperature", float("nan")), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("frequency_penalty", 2.1), ("frequency_penalty", -2.5),
    ("presence_penalty", 3.0), ("presence_penalty", -2.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("repetition_penalty", -1.0),
    ("max_new_tokens", -1), ("max_new_tokens", "10"),
    ("min_new_tokens", -1), ("min_new_tokens", 200),  # > max_new_tokens=128
    ("n", 0), ("n", 1.0),
    ("sampling_seed", "abc"), ("sampling_seed", 1.5),
    ("logit_bias", {str(V): 1.0}), ("logit_bias", {"-1": 1.0}), ("logit_bias", {"x": 1.0}),
    ("logit_bias", {"3": "big"}), ("logit_bias", [1, 2]),
    # OpenAI's range; beyond float32 the logits (and the logprobs in the response) become inf / NaN
    ("logit_bias", {"3": 100.5}), ("logit_bias", {"3": -101}), ("logit_bias", {"3": 1e39}),
    ("logit_bias", {"3": float("inf")}), ("logit_bias", {"3": float("nan")}),
    ("stop", 5), ("stop", ["ok", 3]),
    ("stop_token_ids", [1, V]), ("stop_token_ids", ["1"]),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1),
]


@pytest.mark.parametrize("name,value", BAD_PARAMS, ids=[f"{n}={v!r}" for n, v in BAD_PARAMS])
def test_verify_rejects(name: str, value):
    p = SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=name):
        p.verify(V)


def test_verify_accepts_edges():
    for kw in [dict(temperature=0.0), dict(top_p=1.0, top_k=-1, min_p=1.0), dict(top_k=1, min_p=0.0),
               dict(frequency_penalty=-2, presence_penalty=2, repetition_penalty=2.0),
               dict(max_new_tokens=0), dict(max_new_tokens=None, min_new_tokens=5),
               dict(min_new_tokens=128), dict(logit_bias={"0": -100, V - 1: 100.0}, sampling_seed=-3)]:
        SamplingParams(**kw).verify(V)
    SamplingParams(logit_bias={"123456": 1.0}).verify()  # no vocab size: range unchecked


def test_verify_message_names_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5).verify()


def test_from_dict_and_to_dict():
    with pytest.raises(ValueError, match="'tmperature'"):
        SamplingParams.from_dict({"tmperature": 0.5, "top_p": 0.9})
    with pytest.raises(ValueError, match="json_scheme"):  # a typo of a known field is still rejected
        SamplingParams.from_dict({"json_scheme": "{}"})
    p = SamplingParams.from_dict({"seed": 11, "temperature": 0.0, "stop": "END", "top_k": None})
    assert p.sampling_seed == 11 and p.temperature == 0.0 and p.top_k == -1
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert set(p.to_dict()) == set(SamplingParams.field_names()) and "stop_str_max_len" not in p.to_dict()
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    assert SamplingParams.from_dict(None) == SamplingParams()
    # null max_new_tokens is "up to the context" (the chat route sends it without max_tokens), not 128
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens is None
    assert SamplingParams.from_dict({}).max_new_tokens == 128
    d = SamplingParams().to_dict()
    assert (d["max_new_tokens"], d["temperature"], d["top_p"], d["top_k"], d["min_p"], d["n"]) == (128, 1.0, 1.0, -1, 0.0, 1)


def test_normalize():
    class Tok:
        def encode(self, s, add_special_tokens=True):
            return s.split()

    p = SamplingParams(stop="a b c", stop_token_ids=[3, 3, 4], logit_bias={"7": 1.0})
    p.normalize(Tok())
    assert p.stop == ["a b c"] and p.stop_str_max_len == 3 and p.stop_token_ids == [3, 4]
    assert p.logit_bias == {7: 1.0}
    q = SamplingParams(stop=["xy", "hello"])
    q.normalize(None)
    assert q.stop_str_max_len == 5 and q.stop_strs == ["xy", "hello"]
    r = SamplingParams()
    r.normalize(None)
    assert r.stop == [] and r.stop_str_max_len == 0


def test_choice_seeds_of_an_n_request_differ_and_keep_choice_0():
    seeds = [choice_seed(7, j) for j in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(7, j) for j in range(64)]  # a function of (seed, index) only
    assert choice_seed(8, 1) not in (seeds[1], 8, 7)  # neighbouring seeds do not share choices
    sp = SamplingParams(temperature=1.0, sampling_seed=7, n=3, stop=["x"])
    sp.normalize()
    c1 = sp.for_choice(1)
    assert sp.for_choice(0) is sp and c1.sampling_seed == seeds[1] and sp.sampling_seed == 7
    assert c1.stop_str_max_len == sp.stop_str_max_len and c1.stop == sp.stop  # derived fields kept
    unseeded = SamplingParams(temperature=1.0, n=2)
    assert unseeded.for_choice(1) is unseeded  # unseeded choices already draw different numbers
