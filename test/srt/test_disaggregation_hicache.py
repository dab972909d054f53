"""PD disaggregation with HiCache on either side (in-process, fake transfer backend).

Prefill server with HiCache: a prompt's KV evicted to the host is loaded back, layer by layer, for a
later prompt sharing its prefix; the loaded pages then move to the decode server like any others.
Decode server with HiCache: committed PD requests are released into its HiRadix cache like any
request (and backed up); a retracted request's recompute hits them. Greedy tokens equal a combined
server without HiCache, and once both cache tiers give back what they hold every device, host and
request slot is free again. Negative control: a zeroed host copy changes what the decode server
produces, so the tokens really come through the host tier.
"""

from __future__ import annotations

import random

import pytest

from sglang.srt.disaggregation.decode import DecodeScheduler
from sglang.srt.managers.scheduler import Scheduler
from test_disaggregation import _combined, _free_at_rest, _pair, _run_pd

HICACHE = dict(enable_hierarchical_cache=True)


def _settle(*scheds) -> None:
    """Let every HiCache copy finish and be acknowledged, then check the tree and the slot counts."""
    for s in scheds:
        tc = s.tree_cache
        if hasattr(tc, "controller"):
            tc.controller.wait_idle()
            tc.check_events()
            tc.check_invariants()
        assert s.kv_leak_report() is None, s.kv_leak_report()


@pytest.mark.parametrize("page_size,corrupt_host", [(1, False), (64, False), (1, True)])
def test_prefill_host_hit_is_loaded_back_then_sent(page_size, corrupt_host):
    rng = random.Random(page_size)
    n = 100 if page_size == 1 else 200  # >= 3 pages of 64
    base = [rng.randrange(5, 900) for _ in range(n)]
    fillers = [[rng.randrange(5, 900) for _ in range(n)] for _ in range(3)]
    first, second = base + [11, 12, 13], base + [21, 22, 23, 24]
    want = _combined([first, second], 8, page_size)
    # the device holds two prompts: the fillers push the first one's KV out to the host
    p, d, port = _pair(page_size, prefill_kw=dict(HICACHE, max_total_tokens=256 if page_size == 1 else 512))
    start = _free_at_rest(p), _free_at_rest(d)
    got_first, _, _ = _run_pd(p, d, port, [first], 8)
    _settle(p)  # its backup is committed before the fillers need its device pages
    for f in fillers:
        _run_pd(p, d, port, [f], 8)
        _settle(p)
    tc = p.tree_cache
    match = tc.match_prefix(second[:-1])
    hit = n // page_size * page_size
    assert match.host_hit_length >= hit - page_size, (len(match.device_indices), match.host_hit_length)
    loaded = tc.stats["loaded_tokens"]
    if corrupt_host:
        for dev, host in tc.controller.pairs:
            for lid in range(dev.layer_num):
                host.payload(lid, "kv").zero_()
    got, finals, pouts = _run_pd(p, d, port, [second], 8)
    assert tc.stats["loaded_tokens"] - loaded >= hit - page_size  # the host part was loaded back
    assert pouts[0].cached_tokens >= hit and finals[0].cached_tokens == pouts[0].cached_tokens
    assert got_first[0] == want[0]
    if corrupt_host:
        assert got[0] != want[1]  # what decodes is what came from the host
    else:
        assert got[0] == want[1]
    _settle(p, d)
    assert (_free_at_rest(p), _free_at_rest(d)) == start


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_decode_hicache_caches_pd_requests_and_recompute_hits(policy, monkeypatch):
    """The decode pool is too small for every admitted request's growth: committed PD requests are
    retracted, their KV goes into the HiRadix cache (write_back: backed up to the host as it is
    evicted), and the recomputes hit it (write_back: every one)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    want = _combined(prompts, 40)
    p, d, port = _pair(decode_kw=dict(HICACHE, hicache_write_policy=policy, max_total_tokens=200))
    start = _free_at_rest(p), _free_at_rest(d)
    recomputes = []

    def record(self, batch):
        if batch.forward_mode.is_extend():  # a decode server extends only to recompute
            recomputes.extend(batch.prefix_lens[: batch.num_extend_reqs])
        return Scheduler.run_batch(self, batch)

    monkeypatch.setattr(DecodeScheduler, "run_batch", record)  # on the class: no cycle through `d`
    got, _, _ = _run_pd(p, d, port, prompts, 40)
    _settle(p, d)
    tc = d.tree_cache
    assert d.decode_manager.num_retracted_reqs > 0 and recomputes and any(n > 0 for n in recomputes), recomputes
    if policy == "write_back":  # eviction backs up first, so every recompute finds its prefix
        assert all(n > 0 for n in recomputes), recomputes
    # write_through: a node evicted before its asynchronous backup was acked is dropped, so a
    # recompute may miss when the backup thread lags (a loaded machine): a miss, never wrong tokens
    assert tc.host_total_size() > 0  # released PD requests were backed up
    if policy == "write_back":  # evicted through the host: the recompute loads it back
        assert tc.stats["evicted_to_host"] > 0 and tc.stats["loaded_tokens"] > 0, tc.stats
    assert got == want
    assert (_free_at_rest(p), _free_at_rest(d)) == start
