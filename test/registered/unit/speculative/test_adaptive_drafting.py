"""--speculative-adaptive's policy (speculative/adaptive.py): drafting goes off when the mean of
accepted drafts falls below off_below, a speculative probe runs every probe_every steps while off,
and drafting comes back once a probe lifts the mean to on_at; the flag needs an algorithm."""

import pytest

from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.speculative.adaptive import AdaptiveDrafting


def test_off_when_drafts_fail_probe_then_on_again():
    p = AdaptiveDrafting(probe_every=4)
    assert p.drafts_next() and p.on_step()
    p.observe(3, 1)  # all three drafts accepted
    assert p.drafting and p.drafts_next()
    failed = 0
    while p.drafting:  # drafts keep failing: the mean decays below off_below
        assert p.on_step()
        p.observe(0, 2)
        failed += 1
    assert failed == 7 and p.mean < p.off_below  # 3 x 0.75^7 = 0.40
    pattern = [p.on_step() for _ in range(12)]
    assert pattern == [False, False, False, True] * 3  # one probe every 4 steps
    assert [p.drafts_next() for _ in range(2)] == [False, False]  # pure: asking twice changes nothing
    while not p.drafting:  # probes that accept everything bring it back
        if p.on_step():
            p.observe(6, 2)
    assert p.drafting and p.mean >= p.on_at and all(p.on_step() for _ in range(5))


def test_rows_without_live_requests_change_nothing_and_bad_settings_refused():
    p = AdaptiveDrafting()
    p.observe(0, 0)
    assert p.mean is None and p.drafting
    with pytest.raises(ValueError, match="off_below"):
        AdaptiveDrafting(off_below=0.9, on_at=0.5)
    with pytest.raises(ValueError, match="probe_every"):
        AdaptiveDrafting(probe_every=0)


def test_flag_needs_an_algorithm():
    with pytest.raises(ServerArgsError, match="needs --speculative-algorithm") as e:
        ServerArgs.from_kwargs(model_path="builtin:tiny-deepseek-v32-mtp", speculative_adaptive=True).resolve()
    assert e.value.flag == "speculative_adaptive"
