"""mem_cache.cp_page_map as properties: the int and tensor forms agree, physical_slots is
physical_page at slot granularity, and the map is a bijection onto each owner's pool."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.mem_cache.cp_page_map import page_owner, physical_page, physical_slots


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.integers(0, 500), min_size=1, max_size=40), cp=st.integers(1, 8))
def test_tensor_and_int_forms_agree(pages, cp):
    t = torch.tensor(pages, dtype=torch.int64)
    owners, phys = page_owner(t, cp), physical_page(t, cp)
    assert isinstance(owners, torch.Tensor) and isinstance(phys, torch.Tensor)
    assert owners.dtype == phys.dtype == torch.int64
    assert owners.tolist() == [page_owner(p, cp) for p in pages]
    assert phys.tolist() == [physical_page(p, cp) for p in pages]
    assert all(isinstance(page_owner(p, cp), int) and isinstance(physical_page(p, cp), int) for p in pages)


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(0, 4000), min_size=1, max_size=40), cp=st.integers(1, 8),
       ps=st.sampled_from([1, 4, 16, 64]))
def test_physical_slots_is_physical_page_per_slot(slots, cp, ps):
    t = torch.tensor(slots, dtype=torch.int64)
    got = physical_slots(t, ps, cp)
    expect = [physical_page(s // ps, cp) * ps + s % ps for s in slots]
    assert got.tolist() == expect == [physical_slots(s, ps, cp) for s in slots]
    assert all(0 <= g < (max(slots) // ps // cp + 2) * ps for g in got.tolist())  # inside the owner's pool


@settings(max_examples=50, deadline=None)
@given(cp=st.integers(1, 6), per_owner=st.integers(1, 20))
def test_each_owner_fills_its_pool_densely(cp, per_owner):
    """Logical pages 1..cp*n land on physical pages 1..n of every owner, each exactly once;
    logical page 0 (padding) stays physical page 0."""
    pages = torch.arange(1, cp * per_owner + 1)
    owners, phys = page_owner(pages, cp), physical_page(pages, cp)
    for o in range(cp):
        assert sorted(phys[owners == o].tolist()) == list(range(1, per_owner + 1))
    assert physical_page(0, cp) == 0 and int(physical_page(torch.tensor(0), cp)) == 0
    assert physical_slots(3, 4, cp) == 3  # the padding page's slots stay put
