"""The default-mode speculative output rule (testing/spec_drafts.py) on synthetic outputs."""

from sglang.srt.testing.spec_drafts import within_tolerance_violation


def _out(ids, lps, tops):
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [(lp, t) for lp, t in zip(lps, ids)],
                                             "output_top_logprobs": tops}}


TOL = 1e-3
# plain: token 5 then 7; at position 1 its top-2 are (7, -1.0), (9, -1.0005): a near-tie
TOPS = [[(-0.1, 5), (-3.0, 6)], [(-1.0, 7), (-1.0005, 9)]]
PLAIN = _out([5, 7], [-0.1, -1.0], TOPS)


def test_near_tie_flip_is_accepted_and_a_far_token_is_not():
    assert within_tolerance_violation([PLAIN], [_out([5, 9], [-0.1, -1.0004], TOPS)], TOL) is None
    assert within_tolerance_violation([PLAIN], [PLAIN], TOL) is None
    # not a top-2 token
    assert "parts from plain" in within_tolerance_violation([PLAIN], [_out([5, 11], [-0.1, -1.0], TOPS)], TOL)
    # the first token is no near-tie (gap 2.9 nats)
    assert "parts from plain" in within_tolerance_violation([PLAIN], [_out([6, 7], [-3.0, -1.0], TOPS)], TOL)
    # same tokens, logprob moved by more than the tolerance
    assert "logprob" in within_tolerance_violation([PLAIN], [_out([5, 7], [-0.1, -1.01], TOPS)], TOL)
    # a shorter output
    assert "tokens vs plain" in within_tolerance_violation([PLAIN], [_out([5], [-0.1], TOPS)], TOL)


def test_exact_tie_listed_in_either_order():
    """In an exact tie top-k's order need not be plain's pick (argmax takes the lower id): the
    other of the two is still a numerics flip (seen on the H100: plain picked 6586, top-2 listed
    26346 first, speculation produced 26346)."""
    tops = [[(-0.1, 5), (-3.0, 6)], [(-6.24156, 26346), (-6.24156, 6586)]]
    plain = _out([5, 6586], [-0.1, -6.24156], tops)
    assert within_tolerance_violation([plain], [_out([5, 26346], [-0.1, -6.24156], tops)], TOL) is None
    assert within_tolerance_violation([plain], [_out([5, 1], [-0.1, -6.24156], tops)], TOL) is not None


def test_a_flip_to_the_third_candidate_of_a_flat_distribution():
    """Random weights give flat logits: three candidates within the tolerance (seen on the H100 at
    12 layers: the speculative pick was not in plain's top-2). Past 2 * tol of the best it fails."""
    tops = [[(-0.1, 5), (-3.0, 6)], [(-1.0, 7), (-1.0003, 9), (-1.0006, 4), (-1.5, 8)]]
    plain = _out([5, 7], [-0.1, -1.0], tops)
    assert within_tolerance_violation([plain], [_out([5, 4], [-0.1, -1.0001], tops)], TOL) is None
    assert "top-4" in within_tolerance_violation([plain], [_out([5, 8], [-0.1, -1.0], tops)], TOL)
