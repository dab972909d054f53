"""Tiny, deterministic, locally-built checkpoints: the `builtin:` models (model_loader/builtin.py)
the server runs out of the box, and the tests' checkpoints (no HF hub access).

The checkpoints use transformers' own config classes (``DeepseekV32Config``,
``GlmMoeDsaConfig``, ``DeepseekV3Config``) and ``save_pretrained``, so their
``config.json`` and safetensors layout match what real DeepSeek-V3.2 / GLM-5 /
DeepSeek-V3 checkpoints look like (per-expert weights, fp32 routing bias, ...),
just with a few MB of random weights and a 1024-token byte-level BPE tokenizer
(model_loader/tiny_tokenizer.py).

Determinism: the same ``(arch, seed, dtype, overrides)`` gives bit-identical files
on any machine. torch's CPU ``normal_`` kernel is *not* portable (its AVX2 and
default code paths give different bits), so after ``from_config`` every randomly
initialised tensor is redrawn from a portable generator (numpy PCG64 raw output
and IEEE basic arithmetic only), seeded per tensor name.

CLI::

    python -m sglang.srt.model_loader.tiny_models --arch glm_moe_dsa --out DIR \
        [--seed N] [--dtype bfloat16] [--set num_hidden_layers=6 --set index_topk_freq=2]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
from typing import TYPE_CHECKING, Any

from sglang.srt.model_loader.tiny_tokenizer import (  # noqa: F401  (build_tokenizer / EOS_TOKEN_ID: also used from here)
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

# Bump when the checkpoint contents change for reasons not visible in this file's
# text (the builtin cache key also hashes this file's source).
TINY_MODELS_VERSION = 1

ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")
DTYPES = ("float32", "bfloat16", "float16")

# ---------------------------------------------------------------------------
# Model config
# ---------------------------------------------------------------------------

_YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,  # 4096 / factor: consistent yarn
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_COMMON_DEFAULTS: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
    initializer_range=0.05,
    tie_word_embeddings=False,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
)
# index_topk (32) is far below max_position_embeddings, so sparse selection is
# really exercised once the context exceeds 32 tokens.
_INDEXER_DEFAULTS: dict[str, Any] = dict(index_n_heads=16, index_head_dim=64, index_topk=32)

DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {**_COMMON_DEFAULTS, **_INDEXER_DEFAULTS, "rope_parameters": _YARN_ROPE},
    "glm_moe_dsa": {
        **_COMMON_DEFAULTS,
        **_INDEXER_DEFAULTS,
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # No MTP weights are generated, so do not advertise an MTP layer (HF defaults to 1).
    "deepseek_v3": {**_COMMON_DEFAULTS, "rope_parameters": _YARN_ROPE, "num_nextn_predict_layers": 0},
}

# GlmMoeDsaConfig consumes these in __post_init__ to derive ``indexer_types``.
_GLM_INDEXER_KWARGS = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")


def _config_class(arch: str) -> type:
    import transformers

    names = {
        "deepseek_v32": "DeepseekV32Config",
        "glm_moe_dsa": "GlmMoeDsaConfig",
        "deepseek_v3": "DeepseekV3Config",
    }
    if arch not in names:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {list(ARCHS)}")
    return getattr(transformers, names[arch])


def make_tiny_config(arch: str = "deepseek_v32", **overrides: Any) -> "PreTrainedConfig":
    """The tiny HF config for ``arch`` with ``overrides`` applied (any HF config field)."""
    cls = _config_class(arch)
    kwargs = copy.deepcopy(DEFAULT_CONFIGS[arch])
    kwargs.update(copy.deepcopy(overrides))
    cfg = cls(**kwargs)
    # Make sure the schedule inputs are persisted as plain config.json fields
    # (not only the derived ``indexer_types``), whatever __post_init__ did with them.
    for key in _GLM_INDEXER_KWARGS:
        if key in overrides:
            setattr(cfg, key, copy.deepcopy(overrides[key]))
    return cfg


# ---------------------------------------------------------------------------
# Portable random numbers
# ---------------------------------------------------------------------------


def _portable_normal(n: int, std: float, key: str) -> "Any":
    """~N(0, std^2) float64 samples, bit-identical on every platform.

    Irwin-Hall(4) from PCG64 raw 64-bit output: only integer ops and correctly
    rounded IEEE +,-,* are used (no libm / SIMD transcendental functions).
    Bounded at +-3.46 std, which is fine for random test weights.
    """
    import numpy as np

    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "little")
    raw = np.random.PCG64(seed).random_raw(4 * n).reshape(4, n)
    u = (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)  # [0, 1)
    s = ((u[0] + u[1]) + (u[2] + u[3])) - 2.0  # variance 1/3
    return s * (std * 1.7320508075688772)  # * sqrt(3)


def _redraw_(tensor: "torch.Tensor", std: float, key: str) -> None:
    import torch

    values = _portable_normal(tensor.numel(), std, key)
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(values).reshape(tensor.shape).to(tensor.dtype))


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------


def make_tiny_checkpoint(
    out_dir: str,
    arch: str = "deepseek_v32",
    seed: int = 0,
    dtype: str = "float32",
    mtp_layer: bool = False,
    fp8_block_size: tuple[int, int] | None = None,
    **overrides: Any,
) -> str:
    """Write a tiny random ``arch`` checkpoint plus tokenizer into ``out_dir``; return it.

    ``mtp_layer``: also store a NextN / MTP draft layer (``model.layers.{num_hidden_layers}.*``,
    ``num_nextn_predict_layers = 1``), as DeepSeek-V3.2 and GLM-5 checkpoints do.

    ``fp8_block_size``: save the linears in DeepSeek's block-FP8 format with that block
    (model_loader/fp8_checkpoint.py; the rest stays in ``dtype``).

    ``overrides`` update the default tiny config (e.g. ``num_hidden_layers=6``,
    ``index_topk_freq=4``, ``rope_parameters={...}``). The result depends only on the
    arguments (and the transformers version, through config.json contents).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {list(DTYPES)}")
    cfg = make_tiny_config(arch, **overrides)

    _seed_everything(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()

    std = float(cfg.initializer_range)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF init: constant tensors (norm weights = 1, biases = 0) stay; every
            # normal_-initialised one is redrawn portably (see module docstring).
            flat = param.detach().reshape(-1)
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                continue
            _redraw_(param, std, f"tiny-models/{seed}/{name}")
        # Non-zero routing correction bias, so the bias path of grouped top-k routing
        # is exercised (HF initialises it to zeros).
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                _redraw_(buf, 0.02, f"tiny-models/{seed}/{name}")

    if dtype != "float32":
        target = getattr(torch, dtype)
        model.to(target)
        # Real checkpoints keep the routing bias in fp32 (HF marks it
        # _keep_in_fp32_modules_strict); keep that layout.
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                module.e_score_correction_bias = bias.to(torch.float32)
        model.config.dtype = target

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if mtp_layer:
        _add_mtp_layer(out_dir, cfg.num_hidden_layers, seed)
    if fp8_block_size is not None:
        from sglang.srt.model_loader.fp8_checkpoint import quantize_checkpoint_fp8

        quantize_checkpoint_fp8(out_dir, tuple(fp8_block_size))
    build_tokenizer(out_dir)
    return out_dir


def _add_mtp_layer(out_dir: str, n_layers: int, seed: int) -> None:
    """Append a random MTP layer shaped like the last decoder layer (plus enorm / hnorm / eh_proj /
    shared_head.norm; embedding and head shared with the target, as DeepSeek's checkpoints do)."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {out_dir}, found {files}")
    path = os.path.join(out_dir, files[0])
    tensors = load_file(path)
    src, dst = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    g = torch.Generator().manual_seed(seed + 1000)
    for name in [k for k in tensors if k.startswith(src)]:
        t = tensors[name]
        noise = (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype) if t.dtype.is_floating_point else 0
        tensors[name.replace(src, dst, 1)] = (t + noise).contiguous()
    h = tensors["model.norm.weight"].shape[0]
    dt = tensors["model.norm.weight"].dtype
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{dst}{name}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
    tensors[f"{dst}eh_proj.weight"] = (0.05 * torch.randn(h, 2 * h, generator=g)).to(dt)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    """JSON when it parses (ints, floats, bools, lists, dicts), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        overrides[key.strip()] = _parse_value(value)
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random checkpoint + tokenizer.")
    parser.add_argument("--arch", choices=ARCHS, default="deepseek_v32")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override; VALUE is parsed as JSON when possible (repeatable)",
    )
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(
        args.out, arch=args.arch, seed=args.seed, dtype=args.dtype, **_parse_overrides(args.set)
    )
    print(out)


if __name__ == "__main__":
    main()
