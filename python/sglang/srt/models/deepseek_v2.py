"""DeepSeek-V2/V3 family on one code path: DeepSeek-V3, DeepSeek-V3.2 (DSA) and GLM-5 (GlmMoeDsa).

Per-architecture differences are small and declared on the ForCausalLM subclasses:
- DeepSeek-V3: dense MLA, no indexer.
- DeepSeek-V3.2: DSA indexer with half-split ("neox") rope on its rope dims.
- GLM-5: DSA indexer with interleaved rope; IndexCache layer sharing (issue 5).
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import torch
from torch import nn

from sglang.srt.configs.index_layers import (
    NO_INDEXER,
    LayerIndexRole,
    get_index_layer_schedule,
    layer_index_role,
)
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers import batch_invariant
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_of, yarn_softmax_scale_multiplier
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.layers.moe.moe_registry import create_dispatcher
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import check_weights_complete

logger = logging.getLogger(__name__)


class DeepseekV2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp_group: GroupCoordinator = SINGLE_GROUP,
                 reduce_results: bool = True, dtype=None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp_group=tp_group,
                                                       dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results,
                                           tp_group=tp_group, dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router: fp32 logits; e_score_correction_bias only biases expert choice."""

    def __init__(self, hidden_size: int, num_experts: int, has_bias: bool, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False) if has_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x.float(), self.weight.float())


class DeepseekV2MoE(nn.Module):
    def __init__(self, config, tp_group: GroupCoordinator = SINGLE_GROUP, dtype=None,
                 ep_group: GroupCoordinator = SINGLE_GROUP, dispatch: str = "local") -> None:
        """Expert parallelism: under TP every rank holds every token, so experts split over
        ep_group need no dispatch (their partial sums join the TP all-reduce); under CP tokens differ
        per rank and move to their experts' ranks (`dispatch`: all_to_all or deepep)."""
        super().__init__()
        self.tp_group = tp_group
        n_experts = config.n_routed_experts
        self.topk_config = TopKConfig(
            top_k=config.num_experts_per_tok,
            num_experts=n_experts,
            num_expert_group=getattr(config, "n_group", 1) or 1,
            topk_group=getattr(config, "topk_group", 1) or 1,
            renormalize=getattr(config, "norm_topk_prob", True),
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0) or 1.0,
            scoring_func=getattr(config, "scoring_func", "sigmoid"),
        )
        topk_method = getattr(config, "topk_method", "noaux_tc")
        self.gate = MoEGate(config.hidden_size, n_experts, has_bias=topk_method == "noaux_tc", dtype=dtype)
        ep_tp = SINGLE_GROUP if ep_group.world_size > 1 else tp_group  # EP experts are whole, not TP-sharded
        self.experts = FusedMoE(n_experts, config.hidden_size, config.moe_intermediate_size, tp_group=ep_tp,
                                dispatcher=create_dispatcher(dispatch, ep_group, n_experts), dtype=dtype,
                                ep_group=ep_group)
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = (
            DeepseekV2MLP(config.hidden_size, config.moe_intermediate_size * n_shared, tp_group,
                          reduce_results=False, dtype=dtype) if n_shared else None
        )

    def forward(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        """`forward_batch`: what a wrapper of the block reads (under CP the block gets only the valid
        rows of the rank's compute-padded layout: nsa/cp_backend.install_moe_compaction)."""
        topk = select_experts(self.gate(hidden_states), self.topk_config, self.gate.e_score_correction_bias)
        out = self.experts(hidden_states, topk)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return self.tp_group.all_reduce(out)


class DeepseekV2AttentionMLA(nn.Module):
    def __init__(self, config, layer_id: int, indexer_rope_interleaved: bool, index_role: LayerIndexRole,
                 max_position: int, tp_group: GroupCoordinator = SINGLE_GROUP, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.skip_topk, self.next_skip_topk = index_role.skip_topk, index_role.next_skip_topk
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        tp = tp_group.world_size
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads {self.num_heads} not divisible by tp size {tp}")
        self.num_local_heads = self.num_heads // tp
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        bias = getattr(config, "attention_bias", False)
        rope_params = rope_parameters_of(config)

        if self.q_lora_rank:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one fused matmul.
            self.fused_qkv_a_proj_with_mqa = MergedReplicatedLinear(
                self.hidden_size, [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], bias=bias,
                dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.num_heads * self.qk_head_dim,
                                                 tp_group=tp_group, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(self.hidden_size, self.num_heads * self.qk_head_dim,
                                               tp_group=tp_group, dtype=dtype)
            self.kv_a_proj_with_mqa = ReplicatedLinear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                       bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              tp_group=tp_group, dtype=dtype)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias,
                                        tp_group=tp_group, dtype=dtype)
        self.scaling = self.qk_head_dim**-0.5 * yarn_softmax_scale_multiplier(rope_params)
        mpe = getattr(config, "max_position_embeddings", max_position)
        self.rotary_emb = RotaryEmbedding(self.qk_rope_head_dim, max_position, rope_params, interleaved=True,
                                          max_position_embeddings=mpe)
        self.attn = RadixAttention(layer_id, self.num_local_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                   self.v_head_dim, self.kv_lora_rank, self.scaling)
        self.indexer = None
        if index_role.has_indexer:
            if not self.q_lora_rank:
                raise ValueError("the DSA indexer needs q_lora_rank (it reads the q LoRA output)")
            idx_rope = RotaryEmbedding(self.qk_rope_head_dim, max_position, rope_params,
                                       interleaved=indexer_rope_interleaved, max_position_embeddings=mpe)
            self.indexer = Indexer(self.hidden_size, self.q_lora_rank, config.index_n_heads, config.index_head_dim,
                                   self.qk_rope_head_dim, config.index_topk, layer_id, idx_rope, dtype=dtype)

    def post_load_weights(self) -> None:
        self.attn.set_kv_b_proj(self.kv_b_proj.dequantized_weight())  # read as a matrix: model dtype

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch,
                prev_topk_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = hidden_states.shape[0]
        if self.q_lora_rank:
            q_lora, kv_a = self.fused_qkv_a_proj_with_mqa(hidden_states).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
            q_lora = self.q_a_layernorm(q_lora)
            q = self.q_b_proj(q_lora)
        else:
            q_lora, q = None, self.q_proj(hidden_states)
            kv_a = self.kv_a_proj_with_mqa(hidden_states)
        q = q.view(t, self.num_local_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope)

        # IndexCache: a shared layer reuses the previous layer's top-k; the NextN layer computes
        # its own when none is given. Top-k is passed on only if the next layer reuses it.
        topk_indices = prev_topk_indices
        if self.indexer is not None and not (self.skip_topk and prev_topk_indices is not None):
            topk_indices = self.indexer(hidden_states, q_lora, positions, forward_batch)
        elif self.indexer is not None:  # NextN given the target's top-k: keep its own index K whole
            self.indexer.store_k(hidden_states, positions, forward_batch)
        attn = self.attn(q_nope, q_rope, latent, k_rope, forward_batch, topk_indices)
        out = self.o_proj(attn.reshape(t, self.num_local_heads * self.v_head_dim))
        return out, topk_indices if self.next_skip_topk else None


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, arch: "type[DeepseekV2ForCausalLM]", max_position: int,
                 tp_group: GroupCoordinator = SINGLE_GROUP, dtype=None, is_nextn: bool = False,
                 kv_layer_id: int | None = None, ep_group: GroupCoordinator = SINGLE_GROUP,
                 moe_dispatch: str = "local") -> None:
        """`layer_id`: the checkpoint layer (MoE / IndexCache role); `kv_layer_id`: the layer's slot
        in its KV pool (differs for the NextN layer, whose draft pool has one layer)."""
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = DeepseekV2AttentionMLA(
            config, layer_id if kv_layer_id is None else kv_layer_id, arch.indexer_rope_interleaved,
            arch.index_role(config, layer_id, is_nextn), max_position, tp_group, dtype)
        if is_moe_layer(config, layer_id):
            self.mlp = DeepseekV2MoE(config, tp_group, dtype, ep_group, moe_dispatch)
        else:
            self.mlp = DeepseekV2MLP(config.hidden_size, config.intermediate_size, tp_group, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch, prev_topk_indices: torch.Tensor | None = None):
        """Returns (hidden_states, residual, topk_indices) -- the indices feed the next layer."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, topk_indices = self.self_attn(positions, hidden_states, forward_batch, prev_topk_indices)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if isinstance(self.mlp, DeepseekV2MoE):
            hidden_states = self.mlp(hidden_states, forward_batch)
        else:
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual, topk_indices


def is_moe_layer(config, layer_id: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types and layer_id < len(types):
        return types[layer_id] == "sparse"
    # the NextN/MTP layer (layer_id == num_hidden_layers) follows first_k_dense_replace: MoE
    if not getattr(config, "n_routed_experts", None):
        return False
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return layer_id >= (getattr(config, "first_k_dense_replace", 0) or 0) and layer_id % freq == 0


class DeepseekV2Model(nn.Module):
    def __init__(self, config, arch, max_position: int, tp_group: GroupCoordinator = SINGLE_GROUP,
                 dtype=None, ep_group: GroupCoordinator = SINGLE_GROUP, moe_dispatch: str = "local") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group, dtype=dtype)
        self.layers = nn.ModuleList([
            DeepseekV2DecoderLayer(config, i, arch, max_position, tp_group, dtype, ep_group=ep_group,
                                   moe_dispatch=moe_dispatch)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final hidden states, the top-k the last layer passes on: to the NextN draft layer when
        IndexCache sharing is on, else None)."""
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual, topk_indices = None, None
        pool = forward_batch.token_to_kv_pool  # under CP the rank's own pool (views are per attention call)
        for layer in self.layers:
            hidden_states, residual, topk_indices = layer(positions, hidden_states, residual, forward_batch,
                                                          topk_indices)
            pool.on_layer_end(layer.self_attn.layer_id)  # the layer's slot in the pool
        if hidden_states.shape[0] == 0:
            return hidden_states, topk_indices
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, topk_indices


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_FUSED_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# (fused parameter, HF projection, shard id): HF tensors loaded into slices of one fused weight.
_STACKED = [
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
    ("fused_qkv_a_proj_with_mqa", "q_a_proj", 0),
    ("fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa", 1),
]
_FUSED_SHARDS = {fused: [sid for f, _, sid in _STACKED if f == fused] for fused, _, _ in _STACKED}


def _checkpoint_name(key: str) -> str:
    """Bookkeeping key -> the checkpoint tensor name, so load errors name real tensors:
    "P.experts#3.up_proj" -> "P.experts.3.up_proj.weight", "P.gate_up_proj.weight#1" -> "P.up_proj.weight"
    (an FP8 scale: "P.experts#3.up_proj.weight_scale_inv" -> "P.experts.3.up_proj.weight_scale_inv")."""
    base, sep, rest = key.partition("#")
    if not sep:
        return key
    if base.endswith(".experts"):
        return f"{base}.{rest}" if rest.count(".") == 2 else f"{base}.{rest}.weight"
    prefix, fused, leaf = base.rsplit(".", 2)
    part = next((p for f, p, sid in _STACKED if f == fused and str(sid) == rest), None)
    return f"{prefix}.{part}.{leaf}" if part else key


def _load_named(name: str, tensor: torch.Tensor, load, *args) -> None:
    """Run a weight loader; a ValueError that does not name the checkpoint tensor gets its name."""
    try:
        load(*args)
    except ValueError as e:
        if name in str(e):
            raise
        raise ValueError(f"checkpoint tensor {name!r} (shape {tuple(tensor.shape)}): {e}") from e


def tie_lm_head(model: nn.Module) -> None:
    """`tie_word_embeddings`: the output projection is the embedding (one parameter, both sharded
    the same way over the vocab); a tied checkpoint has no lm_head.weight, or one equal to it."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def _is_tied_head(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and model.lm_head.weight is model.model.embed_tokens.weight


class DeepseekV2ForCausalLM(nn.Module):
    indexer_rope_interleaved = False

    @classmethod
    def index_role(cls, config, layer_id: int, is_nextn: bool = False) -> LayerIndexRole:
        return NO_INDEXER

    def __init__(self, config, max_position: int | None = None, tp_group: GroupCoordinator = SINGLE_GROUP,
                 dtype: torch.dtype | None = None, ep_group: GroupCoordinator = SINGLE_GROUP,
                 moe_dispatch: str = "local") -> None:
        super().__init__()
        self.config = config
        max_position = max_position or config.max_position_embeddings
        self.model = DeepseekV2Model(config, type(self), max_position, tp_group, dtype, ep_group, moe_dispatch)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group, dtype=dtype)
        tie_lm_head(self)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.num_layers = config.num_hidden_layers
        # DeepSeek / GLM checkpoints carry the MTP layer even when configs omit the count.
        self.num_nextn_layers = max(getattr(config, "num_nextn_predict_layers", 1) or 1, 1)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        hidden_states, topk_indices = self.model(input_ids, positions, forward_batch)
        # under CP the logits processor gathers the rows it needs (CPMetadata.logits_output)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch, topk_indices)

    # -- weights ------------------------------------------------------------------------------
    def _ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors this model does not use: the NextN/MTP layers (stored right after the
        decoder layers), rotary caches. Layers beyond those are unexpected, not ignored."""
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and self.num_layers <= int(m.group(1)) < self.num_layers + self.num_nextn_layers:
            return True
        if m and ".self_attn.indexer." in name and int(m.group(1)) < self.num_layers:
            # Checkpoints may ship indexer weights for layers IndexCache makes shared: unused.
            return not type(self).index_role(self.config, int(m.group(1))).has_indexer
        return name.endswith("rotary_emb.inv_freq")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; one error lists every missing and unexpected name."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()  # parameter names, or "name#shard" for stacked / expert parts
        unexpected: set[str] = set()
        for name, tensor in weights:
            if self._ignored_weight(name) or _is_tied_head(self, name):
                continue
            m = _EXPERT_RE.match(name)
            if m and f"{m.group(1)}.w13_weight" in params:
                moe: FusedMoE = self.get_submodule(m.group(1))
                eid = int(m.group(2))
                if eid >= moe.num_experts:
                    unexpected.add(name)
                    continue
                _load_named(name, tensor, moe.load_expert_weight, tensor, eid, _SHARD[m.group(3)], m.group(4))
                leaf = "" if m.group(4) == "weight" else f".{m.group(4)}"
                loaded.add(f"{m.group(1)}#{eid}.{m.group(3)}{leaf}")
                continue
            m = _FUSED_EXPERT_RE.match(name)
            if m and f"{m.group(1)}.w13_weight" in params:
                moe = self.get_submodule(m.group(1))
                _load_named(name, tensor, moe.load_fused_weight, tensor, m.group(2))
                kinds = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
                loaded.update(f"{m.group(1)}#{e}.{k}" for e in range(moe.num_experts) for k in kinds)
                continue
            target, shard_id = name, None
            for fused, part, sid in _STACKED:
                if f".{part}." in name and name.replace(f".{part}.", f".{fused}.") in params:
                    target, shard_id = name.replace(f".{part}.", f".{fused}."), sid
                    break
            param = params.get(target)
            if param is None:
                if tensor.numel() != 0:  # empty ones carry nothing: transformers saves [0, H] shared
                    unexpected.add(name)  # experts for n_shared_experts = 0
                continue
            param.hf_name = name
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                _load_named(name, tensor, loader, param, tensor)
                loaded.add(target)
            else:
                _load_named(name, tensor, loader, param, tensor, shard_id)
                loaded.add(f"{target}#{shard_id}")
        check_weights_complete({_checkpoint_name(k) for k in self._expected_weight_keys()},
                               {_checkpoint_name(k) for k in loaded}, unexpected)
        self.post_load_weights()

    def _expected_weight_keys(self) -> set[str]:
        keys: set[str] = set()
        for name, _ in self.named_parameters():
            m = re.search(r"\.(w13|w2)_weight(_scale_inv)?$", name)
            if m:
                prefix = name[: m.start()]
                moe: FusedMoE = self.get_submodule(prefix)
                kinds = ("gate_proj", "up_proj") if m.group(1) == "w13" else ("down_proj",)
                leaf = ".weight_scale_inv" if m.group(2) else ""
                keys.update(f"{prefix}#{e}.{k}{leaf}" for e in range(moe.num_experts) for k in kinds)
            elif name.split(".")[-2] in _FUSED_SHARDS:
                keys.update(f"{name}#{sid}" for sid in _FUSED_SHARDS[name.split(".")[-2]])
            else:
                keys.add(name)
        return keys

    def post_load_weights(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.post_load_weights()

    def quant_checkpoint_names(self, prefix: str, module: nn.Module) -> list[str]:
        """The checkpoint tensors (names without '.weight') a weight-owning module loads -- each fused part,
        every expert -- so the quantisation config judges the module by what the checkpoint holds."""
        if isinstance(module, FusedMoE):
            return [f"{prefix}.{e}.{p}" for e in range(module.num_experts) for p in _SHARD]
        parent, _, leaf = prefix.rpartition(".")
        parts = [part for fused, part, _ in _STACKED if fused == leaf]
        return [f"{parent}.{part}" for part in parts] if parts else [prefix]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
    indexer_rope_interleaved = False

    @classmethod
    def index_role(cls, config, layer_id: int, is_nextn: bool = False) -> LayerIndexRole:
        """Full IndexCache layers run the indexer; shared ones reuse the previous top-k."""
        return layer_index_role(get_index_layer_schedule(config), layer_id, is_nextn)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    indexer_rope_interleaved = True


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM]
