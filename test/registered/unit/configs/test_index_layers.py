"""The IndexCache schedule: one formula, checked against transformers' GlmMoeDsaConfig."""

import itertools

import pytest
from transformers import GlmMoeDsaConfig

from sglang.srt.configs.index_layers import (
    IndexScheduleError,
    config_index_settings,
    get_index_layer_schedule,
    is_full_layer,
    resolve_index_layer_schedule,
)


def _resolve(n, flags=None, overrides=None, config=None):
    return resolve_index_layer_schedule(n, [("flags", flags or {}), ("overrides", overrides or {}),
                                            ("config", config or {})])


@pytest.mark.parametrize("layers,freq,offset", list(itertools.product([1, 2, 5, 8, 13, 61, 78], [1, 2, 3, 4, 7],
                                                                      [1, 2, 3, 5])))
def test_formula_matches_transformers(layers, freq, offset):
    hf = GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    ours = _resolve(layers, config=config_index_settings(hf))
    assert ours.indexer_types() == hf.indexer_types
    assert ours.indexer_types() == ["full" if is_full_layer(i, freq, offset) else "shared" for i in range(layers)]
    assert ours.full[0]  # layer 0 always runs the indexer


@pytest.mark.parametrize("pattern", ["F", "FS", "FFSF", "FSSSFSSS", "FFFFFFFF"])
def test_pattern_matches_transformers(pattern):
    hf = GlmMoeDsaConfig(num_hidden_layers=len(pattern), index_topk_pattern=pattern)
    assert _resolve(len(pattern), config=config_index_settings(hf)).indexer_types() == hf.indexer_types
    assert _resolve(len(pattern), flags={"index_topk_pattern": pattern}).describe() == pattern


def test_glm52_published_setting():
    s = _resolve(78, config={"index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert len(s.full_layer_ids) == 21 and s.full_layer_ids[:4] == [0, 1, 2, 6]


def test_freq_one_changes_nothing():
    s = _resolve(10, config={"index_topk_freq": 1, "index_skip_topk_offset": 3})
    assert all(s.full) and not s.shares and s.full_layer_ids == list(range(10))
    assert not _resolve(10).shares


def test_skip_and_next_skip():
    s = _resolve(6, flags={"index_topk_pattern": "FFSFSS"})
    assert [s.skip_topk(i) for i in range(6)] == [False, False, True, False, True, True]
    # the last layer passes its top-k on to the NextN draft layer, which shares when sharing is on
    assert [s.next_skip_topk(i) for i in range(6)] == [False, True, False, True, True, True]
    plain = _resolve(6)
    assert not plain.shares and not any(plain.next_skip_topk(i) for i in range(6))


def test_precedence_flags_over_overrides_over_config():
    cfg = {"index_topk_freq": 2, "indexer_types": ["full", "shared", "full", "shared"]}
    assert _resolve(4, config=cfg).describe() == "FFSF"  # freq 2, offset 2 (pattern-free config)
    assert _resolve(4, overrides={"index_topk_freq": 1}, config=cfg).describe() == "FFFF"
    assert _resolve(4, flags={"index_topk_pattern": "FSSS"}, config=cfg).describe() == "FSSS"
    assert _resolve(4, flags={"index_topk_freq": 4, "index_skip_topk_offset": 1}).describe() == "FSSS"
    # an overridden offset applies to the config's freq
    assert _resolve(8, overrides={"index_skip_topk_offset": 1}, config={"index_topk_freq": 4}).describe() == "FSSSFSSS"
    assert _resolve(4, config={"indexer_types": ["full", "shared", "shared", "full"]}).describe() == "FSSF"


@pytest.mark.parametrize("kw,key", [
    ({"flags": {"index_topk_pattern": "FSF"}}, "index_topk_pattern"),  # wrong length
    ({"flags": {"index_topk_pattern": "FXSF"}}, "index_topk_pattern"),  # wrong char
    ({"flags": {"index_topk_pattern": "SFFF"}}, "index_topk_pattern"),  # layer 0 shared
    ({"flags": {"index_topk_freq": 0}}, "index_topk_freq"),
    ({"flags": {"index_topk_freq": 2, "index_skip_topk_offset": 0}}, "index_skip_topk_offset"),
    ({"overrides": {"index_topk_freq": 2, "index_skip_topk_offset": -1}}, "index_skip_topk_offset"),
    ({"flags": {"index_topk_freq": 2, "index_topk_pattern": "FSFS"}}, "index_topk_pattern"),
    ({"flags": {"index_topk_freq": 2}, "overrides": {"index_topk_freq": 4}}, "index_topk_freq"),
    ({"config": {"indexer_types": ["full", "partial", "full", "full"]}}, "indexer_types"),
])
def test_bad_schedules_are_errors(kw, key):
    with pytest.raises(IndexScheduleError) as e:
        _resolve(4, **kw)
    assert e.value.key == key


def test_model_reads_the_resolved_schedule():
    hf = GlmMoeDsaConfig(num_hidden_layers=8, index_topk_freq=4)
    assert get_index_layer_schedule(hf).indexer_types() == hf.indexer_types
