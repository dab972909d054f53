"""Checkpoint loading end to end on tiny checkpoints (CPU): error reporting and layout variants.

Each test builds on a tiny transformers-saved checkpoint (``make_tiny_checkpoint``) copied into
``tmp_path`` and rewrites its safetensors: missing/unexpected and mis-shaped tensors must give one
clear ValueError; fused experts, sharded files, FP8 block quantisation and NextN/MTP extras must
load to the expected logits; unknown architectures are named; bf16 loads keep the fp32 islands.

FP8 tolerance: loading the FP8 checkpoint equals loading the fp32 checkpoint of its dequantised
weights (atol 1e-6; in practice bit-identical, dequantisation is exact in fp32). Against the
original fp32 weights: e4m3 rounding gives a per-tensor relative weight error of ~2.7% (bound
here: 4%), and the tiny random models amplify that like any weight noise -- Gaussian noise of the
same 2.7% gives the same logit error (mean |diff| ~0.08 on logits of std ~0.56; the max is
dominated by flipped MoE routing / sparse-index choices and reaches ~1-2). So the bounds are on the
mean: mean |diff| < 0.15 and mean per-position cosine > 0.94. A wrong scale (x1.25) already gives
mean |diff| ~0.26, cosine ~0.82.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest


import torch
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.entrypoints.engine import Engine
from sglang.srt.testing.runner_utils import prefill_all_logits
from sglang.srt.model_loader.loader import get_model
from sglang.srt.model_loader.weight_utils import block_dequant_fp8, quantize_fp8_block
from sglang.srt.models.registry import supported_architectures
from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

ARCHS = ["deepseek_v32", "glm_moe_dsa", "deepseek_v3"]
DSA_ARCHS = ["deepseek_v32", "glm_moe_dsa"]
NUM_LAYERS = 4  # tiny default; layer 0 is dense, 1..3 are MoE
NUM_EXPERTS = 8
PROMPT_LENS = [5, 40]  # index_topk is 32: the second prompt uses sparse selection
FP8_VS_DEQUANT_ATOL = 1e-6
FP8_WEIGHT_REL_ERR = 0.04  # per-tensor ||dequant - w|| / ||w||
FP8_LOGIT_MEAN_ABS = 0.15  # mean |fp8 logits - original logits|
FP8_LOGIT_MEAN_COS = 0.94


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    """arch -> directory of a pristine tiny fp32 checkpoint (built once per session)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(str(out), arch=arch, seed=0, dtype="float32")
            cache[arch] = out
        return cache[arch]

    return get


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _read(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(ckpt: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    """Replace the checkpoint's weights by ``tensors`` (one file, or ``num_shards`` + an index)."""
    for f in list(ckpt.glob("*.safetensors")) + list(ckpt.glob("*.safetensors.index.json")):
        f.unlink()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}  # interleaved: layers span shards
        save_file(part, str(ckpt / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _edit_config(ckpt: Path, **fields) -> None:
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))


def _load_model(ckpt: Path, dtype: str = "float32", **kw):
    return get_model(ModelConfig(str(ckpt), dtype), **kw)


def _engine(ckpt: Path, dtype: str = "float32", **kw) -> Engine:
    return Engine(model_path=str(ckpt), dtype=dtype, device="cpu", max_total_tokens=4096,
                  nsa_index_k_dtype="float32", random_seed=0, **kw)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _prefill_all_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """One batched extend of every prompt through the model runner; logits of every position."""
    return torch.cat(prefill_all_logits(engine.scheduler.tp_worker.model_runner, prompts)).float()


def _logits(ckpt: Path, dtype: str = "float32", **kw) -> torch.Tensor:
    return _prefill_all_logits(_engine(ckpt, dtype, **kw), _prompts())


DEQUANT = {"dequantize_fp8_weights": True}  # these tests check the dequantising loader (the reference path)


def _assert_identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"{what}: {m}")


def _expert_names(layer: int, e: int) -> list[str]:
    p = f"model.layers.{layer}.mlp.experts.{e}"
    return [f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"]


def _to_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down -> ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
    out = dict(tensors)
    for layer in range(1, NUM_LAYERS):
        gate_up, down = [], []
        for e in range(NUM_EXPERTS):
            g, u, d = (out.pop(n) for n in _expert_names(layer, e))
            gate_up.append(torch.cat([g, u], dim=0))
            down.append(d)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def _is_quantised(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3.2 style: every 2-D linear weight except norms, embeddings, lm_head and the router."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return False
    if "norm" in name or "embed_tokens" in name or name.startswith("lm_head") or name.endswith("mlp.gate.weight"):
        return False
    return True


def _fp8_quantise(tensors: dict[str, torch.Tensor], block: tuple[int, int]):
    """(fp8 checkpoint tensors, fp32 tensors holding the dequantised weights)."""
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if _is_quantised(name, t):
            q, s = quantize_fp8_block(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = block_dequant_fp8(q, s, block, torch.float32)
        else:
            fp8[name] = deq[name] = t
    return fp8, deq


def _quant_config(block) -> dict:
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        cfg["weight_block_size"] = list(block)
    return cfg


# ------------------------------------------------------------------------------------------------
# (a) missing + unexpected tensors: one error naming both
# ------------------------------------------------------------------------------------------------

_REMOVED = [
    "model.layers.0.self_attn.o_proj.weight",  # plain linear
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",  # may be stacked with q_a_proj
    "model.layers.0.mlp.up_proj.weight",  # half of a stacked (gate_up) dense MLP
    "model.layers.2.mlp.shared_experts.gate_proj.weight",  # half of the stacked shared expert
    "model.layers.1.mlp.experts.3.up_proj.weight",  # one routed expert's shard
    "model.layers.3.mlp.gate.e_score_correction_bias",  # routing bias
    "model.layers.1.self_attn.indexer.weights_proj.weight",  # DSA indexer (fp32 param)
    "model.norm.weight",
]
_BOGUS = ["model.layers.1.mlp.bogus_proj.weight", "model.layers.2.mlp.experts.8.gate_proj.weight"]


@pytest.mark.parametrize("arch,removed", [(a, r) for a in ARCHS for r in _REMOVED
                                          if "indexer" not in r or a in DSA_ARCHS])  # V3 has no indexer
def test_missing_and_unexpected_named_in_one_error(base_ckpt, tmp_path, arch, removed):
    ckpt = _copy(base_ckpt(arch), tmp_path / "ckpt")
    tensors = _read(ckpt)
    del tensors[removed]
    bogus = _BOGUS[len(removed) % 2]
    tensors[bogus] = torch.zeros(64, 128)
    _write(ckpt, tensors)
    with pytest.raises(ValueError) as exc:
        _load_model(ckpt)
    msg = str(exc.value)
    assert removed in msg, msg
    assert bogus in msg, msg
    assert "1 missing" in msg and "1 unexpected" in msg, msg


def test_missing_fused_expert_tensor_lists_experts(base_ckpt, tmp_path):
    ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "ckpt")
    tensors = _to_fused_experts(_read(ckpt))
    del tensors["model.layers.2.mlp.experts.down_proj"]
    _write(ckpt, tensors)
    with pytest.raises(ValueError) as exc:
        _load_model(ckpt)
    msg = str(exc.value)
    assert f"{NUM_EXPERTS} missing" in msg, msg
    for e in range(NUM_EXPERTS):
        assert f"model.layers.2.mlp.experts.{e}.down_proj.weight" in msg, msg


def test_engine_reports_missing_and_unexpected(base_ckpt, tmp_path):
    ckpt = _copy(base_ckpt("glm_moe_dsa"), tmp_path / "ckpt")
    tensors = _read(ckpt)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    tensors["lm_head.extra"] = torch.zeros(3)
    _write(ckpt, tensors)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight.*lm_head\.extra"):
        _engine(ckpt)


# ------------------------------------------------------------------------------------------------
# (b) wrong shape: a clear error naming the tensor
# ------------------------------------------------------------------------------------------------

_RESHAPED = [
    ("model.layers.0.self_attn.o_proj.weight", (128, 127)),
    ("model.layers.2.self_attn.q_a_proj.weight", (64, 100)),
    ("model.layers.0.mlp.gate_proj.weight", (255, 128)),  # stacked dense MLP shard
    ("model.layers.2.mlp.shared_experts.up_proj.weight", (64, 129)),  # stacked shared expert shard
    ("model.layers.1.mlp.experts.5.down_proj.weight", (128, 63)),  # routed expert
    ("model.layers.3.mlp.gate.weight", (7, 128)),  # router
    ("model.layers.3.mlp.gate.e_score_correction_bias", (9,)),
    ("model.embed_tokens.weight", (1000, 128)),
    ("lm_head.weight", (1024, 64)),
    ("model.layers.1.self_attn.indexer.wk.weight", (64, 120)),
]


@pytest.mark.parametrize("name,shape", _RESHAPED)
def test_wrong_shape_names_tensor(base_ckpt, tmp_path, name, shape):
    ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "ckpt")
    tensors = _read(ckpt)
    assert tuple(tensors[name].shape) != shape
    tensors[name] = torch.zeros(shape)
    _write(ckpt, tensors)
    with pytest.raises(ValueError) as exc:
        _load_model(ckpt)
    msg = str(exc.value)
    assert name in msg, msg
    assert str(tuple(shape)) in msg, msg


@pytest.mark.parametrize("name,shape", [
    ("model.layers.1.mlp.experts.gate_up_proj", (NUM_EXPERTS - 1, 128, 128)),  # too few experts
    ("model.layers.1.mlp.experts.gate_up_proj", (NUM_EXPERTS + 1, 128, 128)),  # too many experts
    ("model.layers.2.mlp.experts.down_proj", (NUM_EXPERTS, 64, 128)),  # transposed
])
def test_wrong_fused_expert_shape_names_tensor(base_ckpt, tmp_path, name, shape):
    ckpt = _copy(base_ckpt("deepseek_v3"), tmp_path / "ckpt")
    tensors = _to_fused_experts(_read(ckpt))
    assert tuple(tensors[name].shape) != shape
    tensors[name] = torch.zeros(shape)
    _write(ckpt, tensors)
    with pytest.raises(ValueError) as exc:
        _load_model(ckpt)
    msg = str(exc.value)
    assert name in msg and str(tuple(shape)) in msg, msg


# ------------------------------------------------------------------------------------------------
# (c) fused experts and (d) sharded files: identical logits
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def base_logits(base_ckpt):
    cache: dict[str, torch.Tensor] = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in cache:
            cache[arch] = _logits(base_ckpt(arch))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_expert_checkpoint_gives_identical_logits(base_ckpt, base_logits, tmp_path, arch):
    ckpt = _copy(base_ckpt(arch), tmp_path / "ckpt")
    tensors = _to_fused_experts(_read(ckpt))
    assert tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 128, 128)
    assert tensors["model.layers.1.mlp.experts.down_proj"].shape == (NUM_EXPERTS, 128, 64)
    _write(ckpt, tensors)
    _assert_identical(_logits(ckpt), base_logits(arch), f"{arch} fused experts")


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_gives_identical_logits(base_ckpt, base_logits, tmp_path, arch):
    ckpt = _copy(base_ckpt(arch), tmp_path / "ckpt")
    _write(ckpt, _read(ckpt), num_shards=3)
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    # A stray file outside the index must not be read (it would be "unexpected" otherwise).
    save_file({"stray.weight": torch.zeros(2)}, str(ckpt / "consolidated.safetensors"))
    _assert_identical(_logits(ckpt), base_logits(arch), f"{arch} sharded")


# ------------------------------------------------------------------------------------------------
# (e) FP8 block-quantised checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32), None])  # None: weight_block_size omitted
def test_fp8_block_checkpoint(base_ckpt, base_logits, tmp_path, arch, block):
    src = _read(base_ckpt(arch))
    fp8, deq = _fp8_quantise(src, block or (128, 128))
    quantised = [n for n in fp8 if n.endswith("_scale_inv")]
    quantised_bases = {n[: -len("_scale_inv")] for n in quantised}
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in quantised
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in fp8 and "lm_head.weight_scale_inv" not in fp8
    assert fp8["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn

    q_ckpt = _copy(base_ckpt(arch), tmp_path / "fp8")
    _write(q_ckpt, fp8)
    _edit_config(q_ckpt, quantization_config=_quant_config(block))
    d_ckpt = _copy(base_ckpt(arch), tmp_path / "dequant")
    _write(d_ckpt, deq)

    q_logits, d_logits = _logits(q_ckpt, **DEQUANT), _logits(d_ckpt)
    torch.testing.assert_close(q_logits, d_logits, atol=FP8_VS_DEQUANT_ATOL, rtol=0)
    for name, t in src.items():
        if name in quantised_bases:
            rel = ((deq[name] - t).norm() / t.norm()).item()
            assert 0 < rel < FP8_WEIGHT_REL_ERR, f"{name}: relative weight error {rel}"
    ref = base_logits(arch)
    mean_abs = (q_logits - ref).abs().mean().item()
    cos = torch.nn.functional.cosine_similarity(q_logits, ref, dim=-1).mean().item()
    assert 0 < mean_abs < FP8_LOGIT_MEAN_ABS, f"{arch} block {block}: mean |fp8 - original| = {mean_abs}"
    assert cos > FP8_LOGIT_MEAN_COS, f"{arch} block {block}: mean cosine {cos}"


def test_fp8_sharded_scales_apart_from_weights(base_ckpt, tmp_path):
    """Weight and its scale_inv in different shards (interleaved split) still pair up."""
    fp8, deq = _fp8_quantise(_read(base_ckpt("deepseek_v32")), (32, 32))
    q_ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "fp8")
    _write(q_ckpt, fp8, num_shards=3)
    _edit_config(q_ckpt, quantization_config=_quant_config((32, 32)))
    d_ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "dequant")
    _write(d_ckpt, deq)
    torch.testing.assert_close(_logits(q_ckpt, **DEQUANT), _logits(d_ckpt), atol=FP8_VS_DEQUANT_ATOL, rtol=0)


def test_fp8_wrong_block_size_is_reported(base_ckpt, tmp_path):
    fp8, _ = _fp8_quantise(_read(base_ckpt("deepseek_v3")), (32, 32))
    ckpt = _copy(base_ckpt("deepseek_v3"), tmp_path / "fp8")
    _write(ckpt, fp8)
    _edit_config(ckpt, quantization_config=_quant_config((128, 128)))  # scales were made for 32x32
    with pytest.raises(ValueError, match="weight_block_size"):
        _load_model(ckpt, dequantize_fp8_weights=True)
    with pytest.raises(ValueError, match="not a multiple of the FP8 block 128"):  # served as FP8: q_lora 64
        _load_model(ckpt)
    _edit_config(ckpt, quantization_config=_quant_config((64, 64)))  # aligned, but not the scales' grid
    with pytest.raises(ValueError, match="weight_block_size"):
        _load_model(ckpt)


# ------------------------------------------------------------------------------------------------
# (f) NextN / MTP layer tensors are ignored
# ------------------------------------------------------------------------------------------------


def _nextn_tensors(src: dict[str, torch.Tensor], fp8: bool) -> dict[str, torch.Tensor]:
    n = NUM_LAYERS
    extra = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(128, 256),
        f"model.layers.{n}.enorm.weight": torch.ones(128),
        f"model.layers.{n}.hnorm.weight": torch.ones(128),
        f"model.layers.{n}.shared_head.norm.weight": torch.ones(128),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(1024, 128),
        f"model.layers.{n}.embed_tokens.weight": torch.randn(1024, 128),
    }
    # A full decoder layer's worth, copied from layer 1 (MoE + attention + indexer).
    for name, t in src.items():
        if name.startswith("model.layers.1."):
            extra[name.replace("model.layers.1.", f"model.layers.{n}.", 1)] = t.clone()
    if fp8:
        extra[f"model.layers.{n}.eh_proj.weight"] = torch.randn(128, 256).to(torch.float8_e4m3fn)
        extra[f"model.layers.{n}.eh_proj.weight_scale_inv"] = torch.ones(4, 8)  # not even a valid grid
        extra[f"model.layers.{n}.mlp.experts.0.up_proj.weight"] = torch.randn(64, 128).to(torch.float8_e4m3fn)
    return extra


@pytest.mark.parametrize("arch", ARCHS)
def test_nextn_layer_tensors_ignored(base_ckpt, base_logits, tmp_path, arch, caplog):
    ckpt = _copy(base_ckpt(arch), tmp_path / "ckpt")
    tensors = _read(ckpt)
    tensors.update(_nextn_tensors(tensors, fp8=False))
    _write(ckpt, tensors, num_shards=2)
    with caplog.at_level(logging.WARNING):
        logits = _logits(ckpt)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    _assert_identical(logits, base_logits(arch), f"{arch} + NextN tensors")


def test_nextn_layer_tensors_ignored_in_fp8_checkpoint(base_ckpt, tmp_path):
    """Unused FP8 NextN tensors (even unpaired or with a bogus scale grid) are dropped before dequant."""
    fp8, deq = _fp8_quantise(_read(base_ckpt("deepseek_v32")), (32, 32))
    fp8.update(_nextn_tensors(fp8, fp8=True))
    q_ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "fp8")
    _write(q_ckpt, fp8)
    _edit_config(q_ckpt, quantization_config=_quant_config((32, 32)))
    d_ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "dequant")
    _write(d_ckpt, deq)
    torch.testing.assert_close(_logits(q_ckpt, **DEQUANT), _logits(d_ckpt), atol=FP8_VS_DEQUANT_ATOL, rtol=0)
    # served as FP8 (model-dtype activations: exactly the dequantised path on CPU), the NextN tensors too
    torch.testing.assert_close(_logits(q_ckpt, fp8_activation_dtype="model_dtype"), _logits(d_ckpt),
                               atol=FP8_VS_DEQUANT_ATOL, rtol=0)


def test_layers_beyond_the_nextn_layer_are_unexpected(base_ckpt, tmp_path):
    """Only the MTP layer right after the decoder stack is ignored: a checkpoint with more decoder
    layers than its config is a mismatch, not something to drop silently."""
    ckpt = _copy(base_ckpt("deepseek_v32"), tmp_path / "ckpt")
    tensors = _read(ckpt)
    n = NUM_LAYERS + 1
    tensors[f"model.layers.{n}.input_layernorm.weight"] = torch.ones(128)
    _write(ckpt, tensors)
    with pytest.raises(ValueError, match=rf"model\.layers\.{n}\.input_layernorm\.weight"):
        _load_model(ckpt)


# ------------------------------------------------------------------------------------------------
# (g) unknown architecture
# ------------------------------------------------------------------------------------------------


def test_unknown_architecture(base_ckpt, tmp_path):
    ckpt = _copy(base_ckpt("deepseek_v3"), tmp_path / "ckpt")
    _edit_config(ckpt, architectures=["FancyNewForCausalLM"])
    for load in (_load_model, _engine):
        with pytest.raises(ValueError) as exc:
            load(ckpt)
        msg = str(exc.value)
        assert "FancyNewForCausalLM" in msg, msg
        for arch in supported_architectures():
            assert arch in msg, msg
    assert {"DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"} <= set(
        supported_architectures())


# ------------------------------------------------------------------------------------------------
# (h) bf16 load of an fp32 checkpoint
# ------------------------------------------------------------------------------------------------

_FP32_ISLANDS = ("indexer.weights_proj.weight", "e_score_correction_bias")


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_load_of_fp32_checkpoint(base_ckpt, base_logits, arch):
    ckpt = base_ckpt(arch)
    engine = Engine(model_path=str(ckpt), dtype="bfloat16", device="cpu", max_total_tokens=4096, random_seed=0)
    model = engine.scheduler.tp_worker.model_runner.model
    seen_fp32 = set()
    for name, p in model.named_parameters():
        if name.endswith(_FP32_ISLANDS):
            assert p.dtype == torch.float32, name
            seen_fp32.add(next(s for s in _FP32_ISLANDS if name.endswith(s)))
        else:
            assert p.dtype == torch.bfloat16, f"{name}: {p.dtype}"
    assert seen_fp32 == (set(_FP32_ISLANDS) if arch in DSA_ARCHS else {"e_score_correction_bias"})
    # The fp32 islands hold the checkpoint's values exactly (no round trip through bf16).
    src = _read(ckpt)
    for name, p in model.named_parameters():
        if p.dtype == torch.float32:
            assert torch.equal(p.detach(), src[name]), name

    logits = _prefill_all_logits(engine, _prompts())
    assert torch.isfinite(logits).all()
    ref = base_logits(arch)
    # bf16 weights + activations vs fp32 agree loosely: measured mean |diff| 0.01-0.02 (logit std
    # ~0.56) and argmax agreement 0.87-0.96; a broken load is off by O(0.3+) on average.
    assert (logits - ref).abs().mean().item() < 0.05
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.75
    out = engine.generate(input_ids=_prompts()[0],
                          sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    assert len(out["output_ids"]) == 4
