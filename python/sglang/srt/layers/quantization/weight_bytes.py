"""Weight bytes per GPU from a model config + quantisation + TP / EP: the memory plan's first term,
computed without building the model (the real V3.2 / GLM-5 shapes are far too large to build here).

It mirrors what DeepseekV2ForCausalLM holds per rank, layer by layer: replicated MLA down-projections
(fused q_a + kv_a), column-parallel q_b / kv_b, row-parallel o_proj, the indexer's replicated wq_b /
wk / fp32 weights_proj, the absorbed MLA's kv_b in the model dtype (w_kc / w_vc are views of it: a
copy only when kv_b is FP8, its dequantised weight), experts split over EP ranks or TP-sharded, vocab-parallel
embedding and head. FP8 layers (quantization.fp8.is_fp8_by_default, the released checkpoints' rule)
cost 1 byte per weight plus an fp32 scale per (bn x bk) block of the rank's matrix. The unit test
checks it byte for byte against `apply.weight_bytes_of` of built tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class WeightBytes:
    """Bytes one rank holds, by part (embedding, attention, indexer, dense_mlp, experts, shared_experts,
    router, norms, head, mla_absorbed, mtp)."""

    parts: dict[str, int] = field(default_factory=dict)

    def add(self, part: str, n: int) -> None:
        self.parts[part] = self.parts.get(part, 0) + int(n)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


class _Counter:
    def __init__(self, out: WeightBytes, dtype_bytes: int, block: tuple[int, int] | None) -> None:
        self.out, self.dt, self.block = out, dtype_bytes, block

    def linear(self, part: str, name: str, rows: int, cols: int, dtype_bytes: int | None = None) -> bool:
        """A [rows, cols] weight of this rank; FP8 (1 B + block scales) when quantised. Returns is_fp8."""
        from sglang.srt.layers.quantization.fp8 import is_fp8_by_default

        if self.block is not None and dtype_bytes is None and is_fp8_by_default(name):
            bn, bk = self.block
            self.out.add(part, rows * cols + 4 * _cdiv(rows, bn) * _cdiv(cols, bk))
            return True
        self.out.add(part, rows * cols * (dtype_bytes or self.dt))
        return False

    def experts(self, part: str, n_local: int, hidden: int, inter_local: int) -> None:
        if self.block is not None:
            bn, bk = self.block
            scales = _cdiv(2 * inter_local, bn) * _cdiv(hidden, bk) + _cdiv(hidden, bn) * _cdiv(inter_local, bk)
            self.out.add(part, n_local * (3 * inter_local * hidden + 4 * scales))
        else:
            self.out.add(part, n_local * 3 * inter_local * hidden * self.dt)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _decoder_layer(c: _Counter, cfg: Any, i: int, tp: int, ep: int, prefix: str) -> None:
    h = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads") // tp
    nope, rope, v = (_get(cfg, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora, kv_lora = _get(cfg, "q_lora_rank"), _get(cfg, "kv_lora_rank")
    a = f"{prefix}.self_attn"
    if q_lora:
        c.linear("attention", f"{a}.fused_qkv_a_proj_with_mqa", q_lora + kv_lora + rope, h)
        c.linear("attention", f"{a}.q_b_proj", heads * (nope + rope), q_lora)
        c.out.add("norms", q_lora * c.dt)
    else:
        c.linear("attention", f"{a}.q_proj", heads * (nope + rope), h)
        c.linear("attention", f"{a}.kv_a_proj_with_mqa", kv_lora + rope, h)
    c.out.add("norms", kv_lora * c.dt)
    kv_b_fp8 = c.linear("attention", f"{a}.kv_b_proj", heads * (nope + v), kv_lora)
    c.linear("attention", f"{a}.o_proj", h, heads * v)
    # absorbed MLA: w_kc / w_vc are views of kv_b in the model dtype -- the weight itself, or its
    # dequantised copy when it is FP8
    c.out.add("mla_absorbed", heads * (nope + v) * kv_lora * c.dt * (1 if kv_b_fp8 else 0))
    if _get(cfg, "index_topk"):
        ih, idim = _get(cfg, "index_n_heads"), _get(cfg, "index_head_dim")
        c.linear("indexer", f"{a}.indexer.wq_b", ih * idim, q_lora)
        c.linear("indexer", f"{a}.indexer.wk", idim, h)
        c.linear("indexer", f"{a}.indexer.weights_proj", ih, h, dtype_bytes=4)
        c.out.add("norms", 2 * idim * c.dt)  # the indexer's k_norm (LayerNorm: weight + bias)
    c.out.add("norms", 2 * h * c.dt)
    m = f"{prefix}.mlp"
    if i < (_get(cfg, "first_k_dense_replace", 0) or 0) or not _get(cfg, "n_routed_experts"):
        inter = _get(cfg, "intermediate_size") // tp
        c.linear("dense_mlp", f"{m}.gate_up_proj", 2 * inter, h)
        c.linear("dense_mlp", f"{m}.down_proj", h, inter)
        return
    e, moe_i = _get(cfg, "n_routed_experts"), _get(cfg, "moe_intermediate_size")
    c.linear("router", f"{m}.gate", e, h, dtype_bytes=c.dt)
    if _get(cfg, "topk_method", "noaux_tc") == "noaux_tc":
        c.out.add("router", 4 * e)  # e_score_correction_bias, fp32
    c.experts("experts", e // ep, h, moe_i if ep > 1 else moe_i // tp)
    n_shared = _get(cfg, "n_shared_experts", 0) or 0
    if n_shared:
        inter = moe_i * n_shared // tp
        c.linear("shared_experts", f"{m}.shared_experts.gate_up_proj", 2 * inter, h)
        c.linear("shared_experts", f"{m}.shared_experts.down_proj", h, inter)


def weight_bytes_per_gpu(cfg: Any, dtype_bytes: int = 2, block_size: tuple[int, int] | None = (128, 128),
                         tp_size: int = 1, ep_size: int = 1, mtp: bool = False) -> WeightBytes:
    """Bytes of weights one rank holds. `cfg`: an HF config (object or config.json dict);
    `block_size`: the FP8 block (None: every weight in the model dtype, e.g. --dequantize-fp8-weights);
    `mtp`: add the NextN draft layer(s) (--speculative-algorithm EAGLE with the checkpoint's MTP layer)."""
    out = WeightBytes()
    c = _Counter(out, dtype_bytes, block_size)
    h, vocab = _get(cfg, "hidden_size"), _get(cfg, "vocab_size")
    shard = _cdiv(vocab, tp_size)
    out.add("embedding", shard * h * dtype_bytes)
    n_layers = _get(cfg, "num_hidden_layers")
    for i in range(n_layers):
        _decoder_layer(c, cfg, i, tp_size, ep_size, f"model.layers.{i}")
    out.add("norms", h * dtype_bytes)
    out.add("head", shard * h * dtype_bytes)
    if mtp:
        for j in range(_get(cfg, "num_nextn_predict_layers", 0) or 0):
            sub = WeightBytes()
            mc = _Counter(sub, dtype_bytes, block_size)
            n = n_layers + j
            _decoder_layer(mc, cfg, n, tp_size, ep_size, f"model.layers.{n}")
            mc.linear("mtp", f"model.layers.{n}.eh_proj", h, 2 * h)
            sub.add("mtp", 3 * h * dtype_bytes)  # enorm, hnorm, shared_head.norm
            sub.add("mtp", 2 * shard * h * dtype_bytes)  # the draft model's own embedding + head parameters
            out.add("mtp", sub.total)
    return out
