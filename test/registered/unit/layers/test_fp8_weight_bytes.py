"""Weight bytes per GPU (layers/quantization/weight_bytes.py) and the memory plan of the real
DeepSeek-V3.2 and GLM-5 at --tp-size 8 on 141 GB cards (issue 30, item 1).

The formula is checked byte for byte against the built tiny models (FP8 and model dtype, bf16 and
fp32); the real configs are written here from their published config.json values (they cannot be
built on this machine). The plan: card bytes - weights - a reserve for the CUDA context, activations
and graphs (RESERVE, an assumption stated here: the server's own activation plan is built in
model_executor/) leaves the KV pool; its tokens come from the server's own per-token KV size
(model_runner.kv_bytes_per_token: the bf16 MLA latent + the FP8 index K of every layer).
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.quantization.apply import weight_bytes_of
from sglang.srt.layers.quantization.weight_bytes import weight_bytes_per_gpu
from sglang.srt.model_loader.loader import get_model

CARD_BYTES = 141 * 10**9  # H200: 141 GB
RESERVE = 12 * 2**30
FP8_BLOCK = (128, 128)

# Published config.json values (deepseek-ai/DeepSeek-V3.2, zai-org/GLM-5; the FP8 checkpoints add
# quantization_config with weight_block_size [128, 128]).
_COMMON = dict(first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
               num_experts_per_tok=8, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_topk=2048,
               num_nextn_predict_layers=1, topk_method="noaux_tc", tie_word_embeddings=False)
REAL = {
    "DeepSeek-V3.2": dict(_COMMON, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                          vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                          num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, qk_nope_head_dim=128,
                          v_head_dim=128, index_n_heads=64, max_position_embeddings=163840),
    "GLM-5": dict(_COMMON, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880,
                  hidden_size=6144, intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
                  num_key_value_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32,
                  max_position_embeddings=202752),
}
# Parameter counts as published (main model; V3.2 = V3's 671B + the indexers): the formula must agree.
PUBLISHED_PARAMS_B = {"DeepSeek-V3.2": 671, "GLM-5": 744}


@pytest.mark.parametrize("name,block,kw", [
    ("tiny-deepseek-v32-fp8", FP8_BLOCK, {}),
    ("tiny-glm-moe-dsa-fp8", FP8_BLOCK, {}),
    ("tiny-deepseek-v32-fp8", None, {"dequantize_fp8_weights": True}),
    ("tiny-deepseek-v32", None, {}),
    ("tiny-deepseek-v32", FP8_BLOCK, {"quantization": "fp8", "load_format": "dummy"}),
])
def test_weight_bytes_match_built_model(builtin_path, name, block, kw):
    path = builtin_path(name)
    cfg = json.load(open(f"{path}/config.json"))
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        model = get_model(ModelConfig(path, dtype), **kw)
        assert weight_bytes_of(model) == weight_bytes_per_gpu(cfg, size, block).total, (name, dtype)


def _kv_bytes_per_token(tmp_path, cfg: dict) -> int:
    from sglang.srt.model_executor.model_runner import kv_bytes_per_token
    from sglang.srt.server_args import ServerArgs

    d = tmp_path / cfg["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    sa = ServerArgs(model_path=str(d), device="cpu", dtype="bfloat16", nsa_index_k_dtype="fp8_e4m3", page_size=64)
    return kv_bytes_per_token(ModelConfig(str(d), "bfloat16"), sa)


@pytest.mark.parametrize("name", list(REAL))
def test_real_models_fit_one_8_gpu_node_as_fp8(tmp_path, name):
    cfg = REAL[name]
    params = weight_bytes_per_gpu(cfg, 2, None, 1, 1).total / 2 / 1e9
    assert abs(params - PUBLISHED_PARAMS_B[name]) / PUBLISHED_PARAMS_B[name] < 0.01, params
    per_token = _kv_bytes_per_token(tmp_path, cfg)
    mla = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    assert mla < per_token < 1.2 * mla, per_token  # bf16 latent + the smaller FP8 index K
    plans = {}
    for tag, block in (("fp8", FP8_BLOCK), ("bf16", None)):
        for ep in (1, 8):  # experts TP-sharded or split over the 8 ranks: the same bytes
            w = weight_bytes_per_gpu(cfg, 2, block, tp_size=8, ep_size=ep, mtp=True)
            kv = CARD_BYTES - RESERVE - w.total
            plans[tag, ep] = (w.total, kv // per_token if kv > 0 else 0)
    print(name, {k: (round(w / 1e9, 1), t) for k, (w, t) in plans.items()})
    for ep in (1, 8):
        w, tokens = plans["fp8", ep]
        assert w < 0.75 * CARD_BYTES, (name, w)
        # KV room for several full-context requests (V3.2 ~503K tokens, GLM-5 ~303K)
        assert tokens >= cfg["max_position_embeddings"], (name, tokens)
        assert plans["bf16", ep][0] > CARD_BYTES, (name, plans["bf16", ep])  # today's plan: two nodes
    assert plans["fp8", 1][0] == plans["fp8", 8][0]


def test_tp_sharding_divides_the_sharded_parts():
    cfg = REAL["DeepSeek-V3.2"]
    one, eight = weight_bytes_per_gpu(cfg, 2, FP8_BLOCK, 1, 1), weight_bytes_per_gpu(cfg, 2, FP8_BLOCK, 8, 1)
    assert eight.parts["experts"] * 8 == one.parts["experts"]
    assert eight.parts["router"] == one.parts["router"]  # replicated
    assert one.parts["indexer"] == eight.parts["indexer"]  # replicated wq_b / wk / weights_proj
    assert 7.5 * eight.total < one.total < 8 * eight.total
