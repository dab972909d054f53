"""The device memory plan: what the KV pool may take once the weights are loaded.

    KV pool = free after the weights - reserve            (--mem-fraction-static auto, the default)
    reserve = activations of the largest step + CUDA graphs + request table + margin

`--mem-fraction-static F` keeps upstream SGLang's meaning -- weights + KV pool take at most F of
the card -- and the plan checks that the other 1 - F holds the reserve (else a start-up error
giving the largest F that does). The weights are what the device reports after loading (so any
dtype or quantisation is counted as it is), never recomputed from the config. The activations
are derived from the config here (`estimate_forward_bytes`, the arithmetic path: CPU, CP) and,
on a GPU, measured by a profile forward of the largest step (model_executor/memory_profile.py);
the plan takes the larger of the two.

The largest step (`max_step_tokens`): with chunked prefill a step computes at most
--chunked-prefill-size tokens (+ the decode rows of a mixed batch); without it one prompt of up to
the context length runs whole, beside up to --max-prefill-tokens of others. Its KV width (the
index-score row length) is the context length.

Every start-up error names the flags that change the outcome (`MemoryPlanError`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sgl_kernel.mla_split import graph_partial_rows, partial_rows
from sgl_kernel.topk_plan import scratch_bytes_per_row

from sglang.srt.layers.logits_processor import INPUT_LOGPROB_CHUNK_ROWS
from sglang.srt.model_executor.cuda_graph_runner import get_batch_sizes_to_capture

GiB = 2**30
# Slack for what no estimate sees: allocator fragmentation, cuBLAS / Triton workspaces, NCCL.
MARGIN_MIN_BYTES = 1 * GiB
MARGIN_FRACTION = 0.10  # of the activation + graph reserve
# Bytes per logit element the sampler may hold at once (fp32 copy, softmax, sort values + int64
# order, cumsum, masks: layers/sampler.py's top-k / top-p path).
SAMPLER_BYTES_PER_LOGIT = 40
DEFAULT_MAX_RUNNING_REQUESTS = 256  # model_runner's cap when --max-running-requests is not given


class MemoryPlanError(RuntimeError):
    """The card cannot hold the weights, the reserve and a KV cache; the message names the flags."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of one rank's forward (TP-local heads and expert widths) that its activations
    scale with."""

    hidden: int
    vocab: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    dtype_bytes: int
    index_heads: int = 0  # 0: no DSA indexer
    index_dim: int = 0
    index_topk: int = 0
    experts: int = 0  # local routed experts; 0: dense only
    top_k: int = 0
    moe_inter: int = 0  # local
    shared_inter: int = 0  # local
    dense_inter: int = 0  # local; 0: no dense layer
    num_layers: int = 1

    @classmethod
    def from_model_config(cls, mc, tp_size: int = 1, ep_size: int = 1, attn_tp_size: int | None = None) -> "ModelShape":
        """`attn_tp_size`: ranks the attention heads split over (1 under CP, else tp_size)."""
        cfg = mc.hf_config
        atp = tp_size if attn_tp_size is None else attn_tp_size
        experts = int(getattr(cfg, "n_routed_experts", 0) or 0)
        moe_tp = 1 if ep_size > 1 else tp_size
        n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        moe_inter = int(getattr(cfg, "moe_intermediate_size", 0) or 0)
        layers = range(mc.num_hidden_layers) if not mc.is_draft_model else [mc.num_hidden_layers]
        from sglang.srt.models.deepseek_v2 import is_moe_layer

        kinds = [is_moe_layer(cfg, i) for i in layers]
        import torch

        return cls(
            hidden=mc.hidden_size, vocab=mc.vocab_size, heads=mc.num_attention_heads // atp,
            q_lora=int(getattr(cfg, "q_lora_rank", 0) or 0), kv_lora=mc.kv_lora_rank, rope=mc.qk_rope_head_dim,
            nope=int(cfg.qk_nope_head_dim), v_head=int(cfg.v_head_dim),
            dtype_bytes=torch.empty((), dtype=mc.dtype).element_size(),
            index_heads=mc.index_n_heads if mc.is_dsa else 0, index_dim=mc.index_head_dim,
            index_topk=mc.index_topk, experts=experts // ep_size if any(kinds) else 0,
            top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if any(kinds) else 0,
            moe_inter=moe_inter // moe_tp, shared_inter=moe_inter * n_shared // tp_size,
            dense_inter=int(getattr(cfg, "intermediate_size", 0) or 0) // tp_size if not all(kinds) else 0,
            num_layers=len(kinds))


@dataclass(frozen=True)
class ActivationEstimate:
    """Peak bytes of one forward (+ sampling), and the phase it peaks in."""

    tokens: int
    kv_width: int
    logit_rows: int
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get) if self.phases else ""


def estimate_forward_bytes(s: ModelShape, tokens: int, kv_width: int, logit_rows: int, *, decode: bool = False,
                           score_budget: int | None = None, sample: bool = True) -> ActivationEstimate:
    """Peak activation bytes of a forward of `tokens` rows whose longest KV row is `kv_width`,
    returning logits for `logit_rows` rows, on the Triton path (layers/attention/nsa/triton_backend.py,
    sgl_kernel.moe.fused_experts). Each phase sums what is alive at once, conservatively (a
    temporary is counted until the phase ends). `score_budget`: the prefill index-score chunk's
    byte cap (the backend's); decode scores a whole [tokens, kv_width] row block."""
    t, d = tokens, s.dtype_bytes
    stream = 3 * t * s.hidden * d  # hidden, residual, the layer output in flight
    common = t * d * (s.q_lora + s.kv_lora + s.rope  # fused q_a / kv_a projection
                      + s.q_lora  # q_a_layernorm
                      + s.heads * (s.nope + s.rope)  # q_b_proj
                      + s.kv_lora + s.rope  # normed latent, roped k_rope
                      + s.heads * s.rope)  # roped q_rope
    phases: dict[str, int] = {}
    topk_out = 0
    if s.index_heads:
        topk_out = t * s.index_topk * 4
        q_idx = t * s.index_heads * s.index_dim
        scores = 0
        if kv_width > s.index_topk:  # shorter rows keep every causal key without scoring
            row = kv_width * 4 + (0 if decode else scratch_bytes_per_row(kv_width, s.index_topk))  # + top-k scratch
            scores = t * row
            if not decode and score_budget is not None:
                scores = min(scores, max(score_budget, row))
        indexer = (q_idx * (4 * d + 1 + 2)  # wq_b, rope, cat, Hadamard; FP8 values + their bf16 copy
                   + t * s.hidden * 4 + 2 * t * s.index_heads * 4  # x.float(), head weights
                   + scores + topk_out)
        phases["attention: indexer"] = stream + common + indexer
    absorb = t * d * (s.heads * s.nope  # q_nope as the bmm reads it
                      + 2 * s.heads * s.kv_lora  # q_lat, o_lat
                      + 2 * s.heads * s.v_head  # project_out + its reshape
                      + s.hidden)  # o_proj
    if decode:  # split-K partials (eager decode allocates them per call)
        absorb += _decode_partial_rows(t, s.heads, s.index_topk or kv_width) * (s.kv_lora + 1) * 4
    phases["attention: MLA"] = stream + common + absorb + topk_out
    if s.experts:
        n = t * s.top_k
        gate = t * s.hidden * 4 + 5 * t * s.experts * 4 + t * s.top_k * 12  # x.float(), router scores, top-k
        routed = n * (s.moe_inter + s.hidden) * d + t * s.hidden * d + 2 * (n + s.experts * 128) * 4
        shared = t * d * (3 * s.shared_inter + s.hidden) if s.shared_inter else 0
        phases["MoE"] = stream + gate + routed + shared + t * s.hidden * d
    if s.dense_inter:
        phases["dense MLP"] = stream + t * d * (3 * s.dense_inter + s.hidden)
    r = logit_rows
    logits = r * s.hidden * d + r * s.vocab * (d + 4 + (SAMPLER_BYTES_PER_LOGIT if sample else 0))
    phases["logits + sampling"] = 2 * t * s.hidden * d + logits
    if not decode:  # prompt logprobs (return_logprob): layers/logits_processor.py's row chunks
        c = min(t, INPUT_LOGPROB_CHUNK_ROWS)
        phases["input logprobs"] = 2 * t * s.hidden * d + c * (s.hidden * d + s.vocab * (d + 4 + 4)) + t * 12
    return ActivationEstimate(tokens, kv_width, logit_rows, phases)


def _decode_partial_rows(batch: int, heads: int, max_keys: int) -> int:
    """Rows of the MLA decode's split-K partials at `batch` tokens: the larger of the two split rules
    (sgl_kernel.mla_split; the plan does not know the mode)."""
    return max(partial_rows(batch, heads, max_keys, inv) for inv in (False, True))


def max_step_tokens(server_args, context_len: int) -> int:
    """The most tokens one forward can compute (module docstring): the plan's profile size."""
    sa = server_args
    if sa.chunked_prefill_size and sa.chunked_prefill_size > 0:
        mixed = (sa.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS) if sa.enable_mixed_chunk else 0
        return sa.chunked_prefill_size + mixed
    longest = min(context_len, sa.max_total_tokens or context_len)
    return sa.max_prefill_tokens - 1 + longest


@dataclass(frozen=True)
class GraphNeeds:
    """One CUDA-graph spec as the plan sees it (rows per request, extra outputs per row)."""

    tokens_per_req: int = 1
    batch_scale: int = 1
    hidden_out: bool = False  # hidden_states kept as an output
    topk_out: bool = False  # the top-k kept as an output


def cuda_graph_bytes(s: ModelShape, context_len: int, max_bs: int, specs: tuple[GraphNeeds, ...] = (GraphNeeds(),)
                     ) -> int:
    """The graph pool of one runner (cuda_graph_runner.py): buckets share the pool's activation
    blocks (largest captured first), but each bucket's outputs stay alive; plus the attention
    backend's preallocated split-K partials and the static input buffers."""
    if not specs or max_bs <= 0:
        return 0
    scale = max(sp.batch_scale for sp in specs)
    top = max_bs * scale
    total = 0
    act = 0
    for sp in specs:
        rows_max = top * sp.tokens_per_req
        act = max(act, estimate_forward_bytes(s, rows_max, context_len, rows_max, decode=True, sample=False).peak)
        per_row = s.vocab * 4 + (s.hidden * s.dtype_bytes if sp.hidden_out else 0) + (
            s.index_topk * 4 if sp.topk_out else 0)
        total += sum(b * sp.tokens_per_req for b in get_batch_sizes_to_capture(top)) * per_row
        total += rows_max * (6 * 8 + s.hidden * s.dtype_bytes)  # static inputs
    rows = graph_partial_rows(top, s.heads, s.index_topk or context_len, None)
    partials = rows * (s.kv_lora + 1) * 4
    return total + act + partials


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    free_after_weights: int
    weights: int
    activations: int
    cuda_graphs: int
    req_to_token: int
    margin: int
    kv_bytes_per_token: int
    kv_tokens: int
    mem_fraction_static: float | None  # None: auto
    step_tokens: int

    @property
    def reserve(self) -> int:
        return self.activations + self.cuda_graphs + self.req_to_token + self.margin

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def free_after_kv(self) -> int:
        return self.free_after_weights - self.kv_bytes

    def describe(self) -> str:
        frac = "auto" if self.mem_fraction_static is None else f"{self.mem_fraction_static:g}"
        return (f"memory plan: {self.total / GiB:.2f} GiB card, weights {self.weights / GiB:.2f} GiB, "
                f"{self.free_after_weights / GiB:.2f} GiB free after them; reserve {self.reserve / GiB:.2f} GiB "
                f"(activations of a {self.step_tokens}-token step {self.activations / GiB:.2f}, CUDA graphs "
                f"{self.cuda_graphs / GiB:.2f}, request table {self.req_to_token / GiB:.2f}, margin "
                f"{self.margin / GiB:.2f}); KV cache {self.kv_tokens} tokens ({self.kv_bytes / GiB:.2f} GiB, "
                f"{self.kv_bytes_per_token} B/token), {self.free_after_kv / GiB:.2f} GiB left for the reserve; "
                f"--mem-fraction-static {frac}")

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out.update(reserve=self.reserve, kv_bytes=self.kv_bytes, free_after_kv=self.free_after_kv)
        return out


_SHRINK = ("lower --chunked-prefill-size / --max-prefill-tokens (the largest step's activations) or "
           "--cuda-graph-max-bs (the graphs), or load fewer weights (dummy runs: --json-model-override-args "
           "'{\"num_hidden_layers\": N}' or '{\"n_routed_experts\": E}')")


def plan_memory(*, total_bytes: int, free_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                activation_bytes: int, graph_bytes: int, req_to_token_bytes: int, step_tokens: int,
                page_size: int, mem_fraction_static: float | None = None,
                max_total_tokens: int | None = None, token_multiple: int | None = None) -> MemoryPlan:
    """The KV capacity in tokens (a multiple of `token_multiple`, default page_size) that leaves
    the reserve free. `free_bytes`: the device's free memory after the weights loaded and the
    allocator's cache was emptied."""
    mult = token_multiple or page_size
    margin = MARGIN_MIN_BYTES + int(MARGIN_FRACTION * (activation_bytes + graph_bytes))
    reserve = activation_bytes + graph_bytes + req_to_token_bytes + margin
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    parts = (f"activations of a {step_tokens}-token step {gib(activation_bytes)}, CUDA graphs {gib(graph_bytes)}, "
             f"request table {gib(req_to_token_bytes)}, margin {gib(margin)}")
    need = f"the weights ({gib(weight_bytes)}) and the reserve ({gib(reserve)}: {parts})"
    budget = free_bytes - reserve
    if mem_fraction_static is not None:
        left = total_bytes * (1 - mem_fraction_static)
        if left < reserve:
            best = math.floor(100 * (1 - reserve / total_bytes)) / 100
            hint = (f"use --mem-fraction-static {best:.2f} or less (or leave it unset: auto)" if best > 0
                    else _SHRINK)
            raise MemoryPlanError(f"--mem-fraction-static {mem_fraction_static} leaves {gib(left)} of the "
                                  f"{gib(total_bytes)} card beside the weights and the KV cache, but the reserve needs "
                                  f"{gib(reserve)} ({parts}): {hint}")
        budget = min(budget, free_bytes - left)
    if budget < mult * kv_bytes_per_token:
        raise MemoryPlanError(f"{need} leave no room for a KV cache on this {gib(total_bytes)} GPU "
                              f"({gib(free_bytes)} free after loading the weights): {_SHRINK}")
    fits = budget // kv_bytes_per_token // mult * mult
    if max_total_tokens is not None:
        if max_total_tokens > fits:
            raise MemoryPlanError(f"--max-total-tokens {max_total_tokens} needs "
                                  f"{gib(max_total_tokens * kv_bytes_per_token)} of KV cache, but {need} leave "
                                  f"room for {fits} tokens ({gib(budget)}): lower --max-total-tokens, or {_SHRINK}")
        fits = max_total_tokens
    return MemoryPlan(total=total_bytes, free_after_weights=free_bytes, weights=weight_bytes,
                      activations=activation_bytes, cuda_graphs=graph_bytes, req_to_token=req_to_token_bytes,
                      margin=margin, kv_bytes_per_token=kv_bytes_per_token, kv_tokens=int(fits),
                      mem_fraction_static=mem_fraction_static, step_tokens=step_tokens)


def draft_memory_needs(draft_config, server_args, tp_group) -> tuple[int, int]:
    """(weight bytes, CUDA-graph bytes) of a speculative draft runner, which is built after the
    target planned the memory both share (speculative/eagle_worker.py): its weights from a
    meta-device instance, its decode graphs (hidden state in and out) from the arithmetic."""
    from sglang.srt.distributed.parallel_state import SINGLE_GROUP
    from sglang.srt.model_loader.loader import model_weight_bytes

    sa = server_args
    cp = sa.enable_nsa_prefill_context_parallel and tp_group.world_size > 1
    model_tp = SINGLE_GROUP if cp else tp_group
    parallel = dict(ep_group=tp_group, moe_dispatch="local") if sa.ep_size > 1 else {}
    weights = model_weight_bytes(draft_config, model_tp, **parallel)
    if sa.disable_cuda_graph or cp:
        return weights, 0
    shape = ModelShape.from_model_config(draft_config, sa.tp_size, sa.ep_size, attn_tp_size=model_tp.world_size)
    max_bs = min(sa.cuda_graph_max_bs, sa.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS)
    return weights, cuda_graph_bytes(shape, draft_config.context_len, max_bs, (GraphNeeds(hidden_out=True),))
