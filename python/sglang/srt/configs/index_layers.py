"""IndexCache: which DSA layers run the indexer ("full") and which reuse the previous layer's
top-k ("shared"). THE one place this rule lives: the model, the NSA KV pools, HiCache and any
transfer code call `get_index_layer_schedule` and nothing recomputes it.

A layer is full iff  max(layer_id - offset + 1, 0) % freq == 0  (offset > 0, so layer 0 is always
full), unless an explicit pattern ("F"/"S" per layer) or indexer_types ("full"/"shared") is given.
freq = 1 makes every layer full: no change at all.

Sources, highest first: the server flags (--nsa-index-topk-freq/-offset/-pattern), then
--json-model-override-args, then the checkpoint's config. The highest source that sets a schedule
(a pattern, a freq or indexer_types) defines it; a source setting both a pattern and a freq, or a
flag disagreeing with an override of the same key, is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_OFFSET = 2
_KEYS = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "indexer_types")


class IndexScheduleError(ValueError):
    def __init__(self, key: str, reason: str) -> None:
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


def is_full_layer(layer_id: int, freq: int, offset: int) -> bool:
    """The skip formula (upstream SGLang #21405 / transformers GlmMoeDsaConfig)."""
    return max(layer_id - offset + 1, 0) % freq == 0


@dataclass(frozen=True)
class IndexLayerSchedule:
    full: tuple[bool, ...]  # per decoder layer
    source: str = "default"

    @property
    def num_layers(self) -> int:
        return len(self.full)

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, f in enumerate(self.full) if f]

    @property
    def shares(self) -> bool:
        return not all(self.full)

    def skip_topk(self, layer_id: int) -> bool:
        return not self.full[layer_id]

    def next_skip_topk(self, layer_id: int) -> bool:
        """The layer after `layer_id` reuses its top-k. After the last layer comes the NextN/MTP
        draft layer, which reuses the target's top-k whenever sharing is on (layer_index_role)."""
        if layer_id + 1 == len(self.full):
            return self.shares
        return layer_id + 1 < len(self.full) and not self.full[layer_id + 1]

    def indexer_types(self) -> list[str]:
        return ["full" if f else "shared" for f in self.full]

    def describe(self) -> str:
        return "".join("F" if f else "S" for f in self.full)


@dataclass(frozen=True)
class LayerIndexRole:
    """What one attention layer does with top-k (upstream's skip_topk / next_skip_topk)."""

    has_indexer: bool  # owns indexer weights and an index-K buffer
    skip_topk: bool  # reuses the previous layer's top-k when one is given
    next_skip_topk: bool  # the next layer reuses this layer's top-k (so pass it on)


NO_INDEXER = LayerIndexRole(False, False, False)


def layer_index_role(schedule: IndexLayerSchedule, layer_id: int, is_nextn: bool = False) -> LayerIndexRole:
    """The NextN/MTP layer always owns an indexer: it runs it when no previous top-k is given
    (a draft forward of its own) and, with sharing on, reuses one when given."""
    if is_nextn:
        return LayerIndexRole(True, schedule.shares, schedule.shares)
    full = schedule.full[layer_id]
    return LayerIndexRole(full, not full, schedule.next_skip_topk(layer_id))


def _from_pattern(pattern: Any, num_layers: int, key: str) -> tuple[bool, ...]:
    if isinstance(pattern, str):
        bad = sorted(set(pattern) - {"F", "S"})
        if bad:
            raise IndexScheduleError(key, f"pattern may only contain 'F' and 'S', found {bad}")
        full = tuple(c == "F" for c in pattern)
    elif isinstance(pattern, (list, tuple)):
        bad = sorted({str(t) for t in pattern} - {"full", "shared"})
        if bad:
            raise IndexScheduleError(key, f"entries must be 'full' or 'shared', found {bad}")
        full = tuple(t == "full" for t in pattern)
    else:
        raise IndexScheduleError(key, f"expected a string of F/S or a list, got {type(pattern).__name__}")
    if len(full) != num_layers:
        raise IndexScheduleError(key, f"has {len(full)} entries for {num_layers} layers")
    if full and not full[0]:
        raise IndexScheduleError(key, "layer 0 must be full (a shared layer needs a previous layer's top-k)")
    return full


def _from_freq(freq: Any, offset: Any, num_layers: int) -> tuple[bool, ...]:
    if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise IndexScheduleError("index_topk_freq", f"must be an integer >= 1, got {freq!r}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset <= 0:
        raise IndexScheduleError("index_skip_topk_offset", f"must be an integer > 0, got {offset!r}")
    return tuple(is_full_layer(i, freq, offset) for i in range(num_layers))


def resolve_index_layer_schedule(num_layers: int, sources: list[tuple[str, dict]]) -> IndexLayerSchedule:
    """`sources`: [(name, {key: value})] highest precedence first; values None mean unset."""
    sources = [(name, {k: v for k, v in src.items() if k in _KEYS and v is not None}) for name, src in sources]
    for name, src in sources:
        if "index_topk_pattern" in src and "index_topk_freq" in src and name != "config":
            raise IndexScheduleError("index_topk_pattern", f"set together with index_topk_freq in {name}; "
                                     "give one schedule")
    # A flag and an override of the same key must agree.
    for key in _KEYS:
        vals = {name: src[key] for name, src in sources if key in src and name in ("flags", "overrides")}
        if len(vals) == 2 and len({repr(v) for v in vals.values()}) == 2:
            raise IndexScheduleError(key, f"server flag {vals['flags']!r} conflicts with "
                                     f"--json-model-override-args {vals['overrides']!r}")
    offset = next((src["index_skip_topk_offset"] for _, src in sources if "index_skip_topk_offset" in src),
                  DEFAULT_OFFSET)
    for name, src in sources:
        if "index_topk_pattern" in src:
            return IndexLayerSchedule(_from_pattern(src["index_topk_pattern"], num_layers, "index_topk_pattern"), name)
        if "index_topk_freq" in src:
            return IndexLayerSchedule(_from_freq(src["index_topk_freq"], offset, num_layers), name)
        if "indexer_types" in src:
            return IndexLayerSchedule(_from_pattern(src["indexer_types"], num_layers, "indexer_types"), name)
    if offset != DEFAULT_OFFSET:
        _from_freq(1, offset, num_layers)  # still validate a lone offset
    return IndexLayerSchedule(tuple([True] * num_layers), "default")


def config_index_settings(hf_config) -> dict:
    return {k: getattr(hf_config, k, None) for k in _KEYS}


def get_index_layer_schedule(hf_config) -> IndexLayerSchedule:
    """The schedule of a (possibly overridden) HF config. ModelConfig resolves flags and
    overrides once and stores the result on the config as `index_layer_schedule`."""
    cached = getattr(hf_config, "index_layer_schedule", None)
    if isinstance(cached, IndexLayerSchedule):
        return cached
    return resolve_index_layer_schedule(hf_config.num_hidden_layers, [("config", config_index_settings(hf_config))])
