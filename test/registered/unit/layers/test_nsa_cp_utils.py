"""The CP split and page map (mem_cache.cp_page_map) and the compute layout (nsa.utils) as
properties (hypothesis), the owner-aware allocator, and
the CP flags."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.layers.attention.nsa.utils import local_layout
from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page, split_request
from sglang.srt.mem_cache.allocator import CPPagedTokenToKVPoolAllocator
from sglang.srt.server_args import ServerArgs, ServerArgsError

MODES = ("in-seq-split", "round-robin-split")


@settings(max_examples=300, deadline=None)
@given(prefix=st.integers(0, 300), extend=st.integers(1, 400), ps=st.sampled_from([1, 4, 64]),
       cp=st.integers(2, 4), mode=st.sampled_from(MODES), prev=st.integers(0, 3))
def test_split_properties(prefix, extend, ps, cp, mode, prev):
    prev_owner = prev % cp if prefix % ps else None
    s = split_request(prefix, extend, ps, cp, mode, prev_owner)
    assert len(s.token_ranks) == extend and all(0 <= r < cp for r in s.token_ranks)  # each token once
    first_new = -(-prefix // ps)
    assert len(s.new_page_owners) == -(-(prefix + extend) // ps) - first_new
    owner = {first_new + j: o for j, o in enumerate(s.new_page_owners)}
    if prefix % ps:
        owner[prefix // ps] = prev_owner
    pages_rank: dict[int, set] = {}
    for i, r in enumerate(s.token_ranks):
        pages_rank.setdefault((prefix + i) // ps, set()).add(r)
    if s.page_aligned:  # every page computed by exactly one rank: its owner
        assert all(rs == {owner[p]} for p, rs in pages_rank.items())
    if prefix % ps and s.page_aligned:
        assert s.token_ranks[0] == prev_owner  # a partly filled prefix page keeps its owner
    if extend == 1:
        assert s.page_aligned  # decode / tiny extends go to the page owner
    n_new = len(s.new_page_owners)
    if mode == "in-seq-split" and n_new >= 2 * cp:
        assert s.page_aligned
        counts = [s.token_ranks.count(r) for r in range(cp)]
        assert max(counts) - min(counts) <= 2 * ps + ps  # balanced up to page granularity
    if mode == "round-robin-split" and ps == 1:
        assert s.token_ranks == [p % cp for p in range(prefix, prefix + extend)]  # upstream's rule


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 50), min_size=1, max_size=5), cp=st.integers(2, 3),
       mode=st.sampled_from(MODES), ps=st.sampled_from([1, 8]))
def test_local_layout_restores_order(lens, cp, mode, ps):
    ranks = [split_request(0, n, ps, cp, mode).token_ranks for n in lens]
    layouts = [local_layout(ranks, r, cp) for r in range(cp)]
    assert len({len(rows) for _, rows, _ in layouts}) == 1  # same row count on every rank
    seen = sorted(g for _, rows, _ in layouts for g in rows if g >= 0)
    assert seen == list(range(sum(lens)))  # the reverse permutation restores every token once
    for r, (lanes, rows, valid) in enumerate(layouts):
        assert [i for i, g in enumerate(rows) if g >= 0] == valid
        start = 0
        for b, lane in enumerate(lanes):  # a lane holds only its request's tokens, in position order
            g = [x for x in rows[start : start + lane] if x >= 0]
            off = sum(lens[:b])
            assert all(off <= x < off + lens[b] for x in g) and g == sorted(g)
            start += lane


def test_page_map_is_a_bijection_per_owner():
    cp = 3
    seen = set()
    for page in range(1, 31):
        key = (page_owner(page, cp), physical_page(page, cp))
        assert key not in seen and key[1] >= 1
        seen.add(key)
    assert physical_page(0, cp) == 0


@pytest.mark.parametrize("mode", MODES)
def test_cp_allocator_gives_split_owners_and_frees(mode):
    cp, ps = 2, 4
    a = CPPagedTokenToKVPoolAllocator(64, ps, cp, mode)
    slots = a.alloc_extend([0, 0], [13, 3], [-1, -1])
    assert len(slots) == 16
    for (pl, n), part in zip([(0, 13), (0, 3)], slots.split([13, 3])):
        split = split_request(pl, n, ps, cp, mode)
        pages = (part // ps).tolist()
        assert [page_owner(p, cp) for p in dict.fromkeys(pages)] == split.new_page_owners
    assert a.available_size() == 64 - 5 * ps
    assert sum(a.owned_pages()) == 5
    # decode continues the last page or opens one with the decode owner rule
    d = a.alloc_decode([14, 4], [int(slots[12]), int(slots[15])])
    assert int(d[0]) == int(slots[12]) + 1
    a.free(torch.cat([slots, d]))
    assert a.available_size() == 64 and a.owned_pages() == [0, 0]
    with pytest.raises(Exception):
        a.free(slots[:1])  # double free is refused


def test_cp_allocator_fails_whole_when_one_owner_is_full():
    a = CPPagedTokenToKVPoolAllocator(16, 4, 2, "round-robin-split")  # 2 pages per owner
    assert a.alloc_extend([0], [12], [-1]) is not None  # pages 0,1,2 -> owners 0,1,0
    before = a.available_size()
    assert a.alloc_extend([0], [8], [-1]) is None  # needs owner 0 again: none left
    assert a.available_size() == before


@pytest.mark.parametrize("argv,flag", [
    (["--tp-size", "2", "--attn-cp-size", "2"], "--attn-cp-size"),
    (["--tp-size", "2", "--attn-cp-size", "1", "--enable-nsa-prefill-context-parallel"], "--attn-cp-size"),
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size"),
    (["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep", "--attn-cp-size", "2",
      "--enable-prefill-cp"], "--moe-a2a-backend"),
    (["--nnodes", "2", "--tp-size", "2"], "--dist-init-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], "--node-rank"),
    (["--nsa-prefill-cp-mode", "halves"], "--nsa-prefill-cp-mode"),
])
def test_bad_cp_flags_name_the_flag(argv, flag):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises((ServerArgsError, SystemExit)) as e:
        prepare_server_args(["--model-path", "x", *argv]).validate()
    if isinstance(e.value, ServerArgsError):
        assert str(e.value).startswith(flag), str(e.value)


def test_upstream_cp_spellings_are_aliases():
    from sglang.srt.server_args import prepare_server_args

    a = prepare_server_args(["--model-path", "x", "--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp",
                             "--cp-strategy", "zigzag"])
    a.validate()
    assert a.enable_nsa_prefill_context_parallel
    assert a.resolve().nsa_prefill_cp_mode == "in-seq-split"
    assert ServerArgs(model_path="x", nsa_prefill_cp_mode="interleave").resolve().nsa_prefill_cp_mode == \
        "round-robin-split"


def test_ranks_fill_each_nodes_gpus_in_order():
    from sglang.srt.distributed.parallel_state import gpu_for_rank, node_ranks

    for world, nnodes in ((2, 1), (4, 1), (8, 2), (16, 4)):
        per = world // nnodes
        for node in range(nnodes):
            assert [gpu_for_rank(r, world, nnodes) for r in node_ranks(world, nnodes, node)] == list(range(per))


def test_too_few_gpus_is_a_clear_error(monkeypatch):
    from sglang.srt.distributed import parallel_state

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="2 ranks per node need 2 GPUs, but this node has 1"):
        parallel_state.bind_rank_gpu(1, 2)
