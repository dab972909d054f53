"""Debug instrumentation installed on a built model as forward hooks, so no model holds debug code.

`install_debug_hooks(model)` (the model loader calls it once per model) reads the environment and
installs only what it asks for; with nothing set it installs no hook and the forward is untouched
(CUDA-graph capture included). What each hook sees is the argument the code it replaced read:
- SGLANG_CP_HICACHE_KV_TRACE=3 (kv_trace.py): per decoder layer of the target model, the
  attention input, the top-k handed to attention, the attention output (before the residual add)
  and the MoE / MLP input, in that order, between `begin_forward` / `end_forward` of each forward;
- SGLANG_CP_POISON_PADDING=1 (checks.py): CP dummy rows of the hidden states and residual filled
  before every decoder layer of the target model;
- SGLANG_DEBUG_CHECKS=1 (checks.py): every attention layer that reuses an inherited top-k (a shared
  IndexCache layer, the NextN layer given the target's) checks it belongs to the batch.

Hooks address modules by the DeepseekV2 names (`model.layers[i].self_attn.attn`, `.mlp`), by duck
type: debug/ sits below the models in the import layers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn

from sglang.srt.debug import checks, kv_trace

_TRACERS: "weakref.WeakKeyDictionary[nn.Module, kv_trace.KVTracer]" = weakref.WeakKeyDictionary()


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _pre_hook(module: nn.Module, fn: Callable[[tuple, dict], object]) -> None:
    """`fn(args, kwargs)` before each forward of `module`; its result is dropped (the arguments
    pass on unchanged, except where `fn` writes into a tensor in place)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        fn(args, kwargs)

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The target model's decoder layers (`model.model.layers`); a NextN draft has none."""
    return list(getattr(getattr(model, "model", None), "layers", None) or [])


def install_kv_trace(model: nn.Module) -> kv_trace.KVTracer | None:
    """Level 3: the per-layer forward records of kv_trace, as hooks on the target's layers."""
    layers = _decoder_layers(model)
    tracer = kv_trace.get_kv_tracer(min_level=3) if layers else None
    if tracer is None:
        return None
    inner = model.model
    _pre_hook(inner, lambda a, k: tracer.begin_forward(_arg(a, k, 2, "forward_batch")))  # eager extends only
    inner.register_forward_hook(lambda _m, _a, _out: tracer.end_forward())
    for layer in layers:
        attn, lid = layer.self_attn, layer.layer_id
        _pre_hook(attn, lambda a, k, lid=lid: tracer.record_forward_rows("attn_in", lid, _arg(a, k, 1, "hidden_states")))
        _pre_hook(attn.attn, lambda a, k, lid=attn.layer_id: tracer.record_forward_rows(
            "topk", lid, _arg(a, k, 5, "topk_indices")))
        attn.register_forward_hook(lambda _m, _a, out, lid=lid: tracer.record_forward_rows("attn_out", lid, out[0]))
        _pre_hook(layer.mlp, lambda a, k, lid=lid: tracer.record_forward_rows("moe_in", lid, _arg(a, k, 0, "x")))
    _TRACERS[model] = tracer
    return tracer


def install_padding_poison(model: nn.Module) -> bool:
    """SGLANG_CP_POISON_PADDING: CP dummy rows poisoned before every decoder layer of the target."""
    layers = _decoder_layers(model) if checks.poison_padding_enabled() else []
    for layer in layers:
        _pre_hook(layer, lambda a, k: checks.poison_padding_rows(
            _arg(a, k, 3, "forward_batch"), _arg(a, k, 1, "hidden_states"), _arg(a, k, 2, "residual")))
    return bool(layers)


def install_topk_checks(model: nn.Module) -> int:
    """SGLANG_DEBUG_CHECKS: an attention layer that will reuse the top-k it is given (no indexer of
    its own, or a shared IndexCache layer) checks it first. Returns the layers checked."""
    if not checks.DEBUG_CHECKS:
        return 0
    attns = [m for m in model.modules() if hasattr(m, "skip_topk") and hasattr(m, "indexer")]

    def check(attn: nn.Module, args: tuple, kwargs: dict) -> None:
        prev = _arg(args, kwargs, 3, "prev_topk_indices")
        if prev is not None and (attn.indexer is None or attn.skip_topk) and checks.debug_checks_active():
            checks.assert_topk_matches_batch(prev, _arg(args, kwargs, 2, "forward_batch"), attn.layer_id)

    for attn in attns:
        _pre_hook(attn, lambda a, k, attn=attn: check(attn, a, k))
    return len(attns)


def install_debug_hooks(model: nn.Module) -> None:
    """Everything the environment asks for; nothing (no hook at all) when it asks for nothing."""
    install_kv_trace(model)
    install_padding_poison(model)
    install_topk_checks(model)


def installed_tracer(model: nn.Module) -> kv_trace.KVTracer | None:
    """The KV tracer whose forward hooks are on `model`, or None."""
    return _TRACERS.get(model)
