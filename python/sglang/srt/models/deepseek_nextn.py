"""The NextN / MTP draft layer of DeepSeek-V3 / V3.2 / GLM-5 (weights at model.layers.{N}.*).

    h = eh_proj(concat(enorm(embed(tokens)), hnorm(target_hidden)))
    h = decoder_layer(h)            # MLA (+ DSA indexer, always owned: see layer_index_role)
    logits = head(shared_head.norm(h))

The draft runs its own forward over its own one-layer KV pool; target and draft share the
request -> token slot map. Checkpoints that omit the MTP layer's embed_tokens / shared_head.head
reuse the target model's embed_tokens / lm_head tensors.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
    DeepseekV32ForCausalLM,
    GlmMoeDsaForCausalLM,
    tie_lm_head,
)


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps=eps)


class DeepseekModelNextN(nn.Module):
    def __init__(self, config, target_arch: type, max_position: int, tp_group: GroupCoordinator = SINGLE_GROUP,
                 dtype=None, ep_group: GroupCoordinator = SINGLE_GROUP, moe_dispatch: str = "local") -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp_group, dtype=dtype)
        self.enorm = RMSNorm(h, eps=eps)
        self.hnorm = RMSNorm(h, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype=dtype)
        self.decoder = DeepseekV2DecoderLayer(config, config.num_hidden_layers, target_arch, max_position, tp_group,
                                              dtype, is_nextn=True, kv_layer_id=0, ep_group=ep_group,
                                              moe_dispatch=moe_dispatch)
        self.shared_head = _SharedHead(h, eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                target_hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(target_hidden)], dim=-1)
        # IndexCache: reuse the target's top-k for these rows when it handed one (extend after a
        # prefill / verify); its own indexer scores otherwise (draft decode steps). What the layer
        # would pass on has no consumer: one draft layer.
        h, residual, _ = self.decoder(positions, self.eh_proj(x), None, forward_batch,
                                      forward_batch.spec.topk_indices)
        forward_batch.token_to_kv_pool.on_layer_end(self.decoder.self_attn.layer_id)  # the draft pool's layer
        if h.shape[0] == 0:
            return h
        h, _ = self.shared_head.norm(h, residual)
        return h


class _NextNMixin:
    """Turns a target ForCausalLM class into its one-layer draft twin."""

    target_arch: type = DeepseekV2ForCausalLM

    def __init__(self, config, max_position: int | None = None, tp_group: GroupCoordinator = SINGLE_GROUP,
                 dtype=None, ep_group: GroupCoordinator = SINGLE_GROUP, moe_dispatch: str = "local") -> None:
        """`ep_group` / `moe_dispatch`: expert parallelism, as get_model passes it to the target."""
        nn.Module.__init__(self)
        self.config = config
        self.num_layers = config.num_hidden_layers
        max_position = max_position or config.max_position_embeddings
        self.model = DeepseekModelNextN(config, self.target_arch, max_position, tp_group, dtype, ep_group,
                                        moe_dispatch)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group, dtype=dtype)
        tie_lm_head(self)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if forward_batch.spec is None:
            raise ValueError("the NextN draft layer needs the target's hidden states (ForwardBatch.spec)")
        h = self.model(input_ids, positions, forward_batch, forward_batch.spec.hidden_states)
        return self.logits_processor(h, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Map model.layers.{N}.* onto the draft; fall back to the target's embedding / head."""
        n = self.num_layers
        prefix = f"model.layers.{n}."
        renamed, fallback = [], {}
        for name, t in weights:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                fallback[name] = t
                continue
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest == "shared_head.head.weight":
                renamed.append(("lm_head.weight", t))
            elif rest.split(".")[0] in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head"):
                renamed.append((f"model.{rest}", t))
            else:
                renamed.append((f"model.decoder.{rest}", t))
        have = {k for k, _ in renamed}
        if "model.embed_tokens.weight" not in have and "model.embed_tokens.weight" in fallback:
            renamed.append(("model.embed_tokens.weight", fallback["model.embed_tokens.weight"]))
        if "lm_head.weight" not in have and "lm_head.weight" in fallback:
            renamed.append(("lm_head.weight", fallback["lm_head.weight"]))
        if not any(k.startswith("model.decoder.") for k in have):
            raise ValueError(f"the checkpoint has no NextN/MTP layer (expected tensors under {prefix}*)")
        DeepseekV2ForCausalLM.load_weights(self, renamed)

    def _ignored_weight(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")

    def quant_checkpoint_names(self, prefix: str, module: nn.Module) -> list[str]:
        """As the target's, under the MTP layer's checkpoint prefix model.layers.{N}."""
        n = f"model.layers.{self.num_layers}."
        prefix = prefix.replace("model.decoder.", n, 1) if prefix.startswith("model.decoder.") else (
            n + prefix[len("model."):] if prefix.startswith("model.") else prefix)
        return DeepseekV2ForCausalLM.quant_checkpoint_names(self, prefix, module)

    def post_load_weights(self) -> None:
        self.model.decoder.self_attn.post_load_weights()


class DeepseekV3ForCausalLMNextN(_NextNMixin, DeepseekV2ForCausalLM):
    target_arch = DeepseekV2ForCausalLM


class DeepseekV32ForCausalLMNextN(_NextNMixin, DeepseekV32ForCausalLM):
    target_arch = DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLMNextN(_NextNMixin, GlmMoeDsaForCausalLM):
    target_arch = GlmMoeDsaForCausalLM


EntryClass = [DeepseekV3ForCausalLMNextN, DeepseekV32ForCausalLMNextN, GlmMoeDsaForCausalLMNextN]
